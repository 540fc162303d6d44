"""GPU check of the Megatron backend on one GPU, in one command (about 4-6 minutes on an H200).

    bash benchmarks/gpu_check.sh run                       # on the GPU machine; carry: .whl
    python benchmarks/gpu_check.py --device cpu --quick    # CPU dry run of the same phases (no GPU)

``gpu_check.sh download`` fills ``.whl/`` first, where the network is (docs/megatron.md). Phases, each
recorded in ``$OUT/gpu_check.json`` as soon as it ends (a timeout keeps what finished):

1. ``model``: the quickstart's tiny Llama (built and SFT-warmed once, cached under ``$OUT/cache``).
2. ``engine``: the torch engine samples completions of task prompts with behaviour log-probs.
3. ``gap``: engine-versus-trainer log-prob gap at step 0 (Megatron bf16 scoring the sampled tokens;
   gate: mean |gap| <= 0.03, the reference CI's corridor), and Megatron fp32 against the fp32 reference
   (gate <= 1e-4).
4. ``parity``: Megatron against FSDP on the same model and micro-batches with the same algorithm loss
   (PPO-clip + entropy, Miles' :func:`miles.algo.losses.policy_loss`): loss within 1e-3, grad norm within
   3% (fp32 on both sides; the bf16 numbers are reported, not gated). Then one optimizer step each and the
   exported HF weights checked against the trainer's own log-probs.
5. ``checkpoint``: dist_checkpointing save, one more step, load: log-probs back to the saved ones.
6. ``rl``: ``miles run recipes/quickstart.yaml`` for a few steps with the torch engine on the GPU
   (trainer.backend.type=megatron when the registry has it wired, else fsdp on CUDA; both recorded).

"FSDP" is :class:`miles.backends.fsdp.FsdpBackend` when it offers the new interface
(``forward_backward`` / ``optimizer_step``), else the same computation done directly on the HF model (FSDP2
on one rank is that computation); the report says which. In the CPU dry run the Megatron side is the
megatron-core model on CPU with the schedule emulated and a torch AdamW (DDP, the distributed optimizer and
the schedules are CUDA-only): it checks this script, not those GPU paths.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

TEMPERATURE = 1.0
GATES = {"gap_mean": 0.03, "fp32_logp": 1e-4, "loss": 1e-3, "grad_norm_rel": 0.03, "export_logp": 1e-4}


class Report:
    """Phase results, written to disk after every phase."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"started": time.time(), "phases": {}, "failures": []}

    def phase(self, name: str, **values: Any) -> None:
        self.data["phases"][name] = values
        self.path.write_text(json.dumps(self.data, indent=2, default=str))
        print(f"[gpu_check] {name}: {json.dumps(values, default=str)}", flush=True)

    def gate(self, name: str, value: float, limit: float) -> bool:
        ok = math.isfinite(value) and value <= limit
        if not ok:
            self.data["failures"].append(f"{name}={value:.3g} > {limit}")
        return ok


# --------------------------------------------------------------------------- data


def build_model(out: Path, quick: bool) -> tuple[Path, Any, Any]:
    """The quickstart model directory, its config and tokenizer."""
    from miles.config import load_config
    from miles.models.loading import load_tokenizer
    from miles.prepare import prepare_model

    sets = ["model.warmup_steps=10", "model.warmup_target_accuracy=null"] if quick else []
    cfg = load_config(ROOT / "recipes" / "quickstart.yaml", sets)
    model_dir = prepare_model(cfg)
    return model_dir, cfg, load_tokenizer(model_dir)


def sample(model_dir: Path, cfg: Any, tokenizer: Any, device: str, n: int) -> list[Any]:
    """``n`` engine generations (behaviour log-probs included) of train prompts, one per prompt."""
    from miles.config import TorchEngineConfig
    from miles.engines.base import SamplingParams
    from miles.engines.torch_engine import TorchEngine
    from miles.models.loading import encode_prompt, load_policy, stop_token_ids
    from miles.tasks.registry import build_task

    model, _ = load_policy(model_dir, "float32", "cpu")
    dtype = "bfloat16" if device == "cuda" else "float32"
    engine = TorchEngine(model, tokenizer.pad_token_id, TorchEngineConfig(device=device, dtype=dtype), seed=0)
    prompts = [encode_prompt(tokenizer, s.prompt) for s in build_task(cfg.task).samples("train")[:n]]
    params = SamplingParams(max_new_tokens=cfg.rollout.sampling.max_new_tokens, temperature=TEMPERATURE)
    params.stop_token_ids = stop_token_ids(tokenizer)
    if inspect.iscoroutinefunction(engine.generate):  # the per-request async engine

        async def run_all() -> list[Any]:
            import asyncio

            return list(await asyncio.gather(*(engine.generate(p, params) for p in prompts)))

        import asyncio

        gens = asyncio.run(run_all())
    else:
        gens = engine.generate(prompts, params)
    return [g for g in gens if g.output_ids]


def pack(gens: list[Any], seqs_per_row: int, rows: int, pad: int, seed: int) -> list[Any]:
    """Miles micro-batches (``MicroBatch``): ``seqs_per_row`` sequences per row, position ids restarting,
    loss mask on the sampled tokens, per-sequence advantages of +-1 and the engine's behaviour log-probs."""
    from miles.backends.base import MicroBatch

    g = torch.Generator().manual_seed(seed)
    per_mb = seqs_per_row * rows
    out = []
    seq_id = 0
    for start in range(0, len(gens) - per_mb + 1, per_mb):
        chunk = gens[start : start + per_mb]
        width = max(
            sum(len(x.prompt_ids) + len(x.output_ids) for x in chunk[r * seqs_per_row : (r + 1) * seqs_per_row])
            for r in range(rows)
        )
        shape = (rows, width)
        t = {k: torch.zeros(shape, dtype=torch.long) for k in ("input_ids", "position_ids", "targets")} | {
            "seq_index": torch.full(shape, -1, dtype=torch.long)
        }
        loss_mask, adv, behaviour = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
        t["input_ids"].fill_(pad)
        for r in range(rows):
            at = 0
            for x in chunk[r * seqs_per_row : (r + 1) * seqs_per_row]:
                ids = list(x.prompt_ids) + list(x.output_ids)
                n, p = len(ids), len(x.prompt_ids)
                t["input_ids"][r, at : at + n] = torch.tensor(ids)
                t["position_ids"][r, at : at + n] = torch.arange(n)
                t["targets"][r, at : at + n - 1] = torch.tensor(ids[1:])
                t["seq_index"][r, at : at + n - 1] = seq_id
                loss_mask[r, at + p - 1 : at + n - 1] = 1.0
                behaviour[r, at + p - 1 : at + n - 1] = torch.tensor(x.logprobs, dtype=torch.float32)
                adv[r, at : at + n] = 1.0 if torch.rand((), generator=g) < 0.5 else -1.0
                at += n
                seq_id += 1
        mb = MicroBatch(loss_mask=loss_mask, **t)
        mb.tensors.update(advantages=adv, behaviour_logp=behaviour)
        out.append(mb)
    return out


def make_loss(total_tokens: float) -> Callable[..., Any]:
    """The algorithm loss both backends optimise: PPO-clip against the behaviour policy, entropy bonus."""
    from miles.algo.losses import policy_loss

    def loss_fn(out: Any, mb: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        dev = out.logp.device
        res = policy_loss(
            out.logp,
            mb.tensors["behaviour_logp"].to(dev),
            mb.tensors["advantages"].to(dev),
            mb.loss_mask.to(dev),
            clip_low=0.2,
            clip_high=0.28,
            entropy=out.entropy,
            entropy_coef=0.01,
            num_tokens=total_tokens,
        )
        return res.loss, {"loss": res.metrics["loss"].double(), "tokens": mb.loss_mask.sum().double().to(dev)}

    return loss_fn


# --------------------------------------------------------------------------- the two sides


def trainer_cfg(kind: str, device: str) -> Any:
    from miles.config import FsdpBackendConfig, MegatronBackendConfig, TrainerConfig

    backend = MegatronBackendConfig() if kind == "megatron" else FsdpBackendConfig(device=device)
    return TrainerConfig(backend=backend, lr=1e-3, grad_clip=1e9, weight_decay=0.0, betas=(0.9, 0.99))


class HfSide:
    """FSDP's computation on one rank, done on the HF model directly: per-sequence forwards (no packing),
    the shared log-prob functions, AdamW, the global grad norm."""

    name = "hf-reference"

    def __init__(self, model_dir: Path, device: str) -> None:
        from miles.models.loading import load_policy

        self.model, _ = load_policy(model_dir, "float32", device)
        self.device = torch.device(device)
        cfg = trainer_cfg("fsdp", device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=0.0)

    def outputs(self, mb: Any, entropy: bool) -> Any:
        from miles.algo.logprobs import token_entropy, token_logprobs
        from miles.backends.base import TokenOutputs
        from miles.backends.megatron.batches import segment_ids

        logp = torch.zeros(mb.targets.shape, device=self.device)
        ent = torch.zeros(mb.targets.shape, device=self.device)
        seg = segment_ids(mb.position_ids)
        for r in range(mb.input_ids.shape[0]):
            for s in torch.unique(seg[r]).tolist():
                idx = (seg[r] == s).nonzero().flatten()
                rows = torch.full_like(idx, r).to(self.device)
                cols = idx.to(self.device)
                logits = self.model(input_ids=mb.input_ids[r, idx].unsqueeze(0).to(self.device)).logits
                targets = mb.targets[r, idx].unsqueeze(0).to(self.device)
                logp = logp.index_put((rows, cols), token_logprobs(logits, targets, TEMPERATURE)[0])
                if entropy:
                    ent = ent.index_put((rows, cols), token_entropy(logits, TEMPERATURE)[0])
        return TokenOutputs(logp=logp, entropy=ent if entropy else None)

    def score(self, batches: list[Any], entropy: bool = False) -> list[Any]:
        with torch.no_grad():
            return [self.outputs(mb, entropy) for mb in batches]

    def forward_backward(self, batches: list[Any], loss_fn: Any, entropy: bool = False) -> dict[str, float]:
        sums: dict[str, float] = {}
        for mb in batches:
            loss, metrics = loss_fn(self.outputs(mb, entropy), mb)
            loss.backward()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        return sums

    def optimizer_step(self, lr: float, *, skip: bool = False) -> float:
        if skip:
            self.opt.zero_grad(set_to_none=True)
            return 0.0
        for group in self.opt.param_groups:
            group["lr"] = lr
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1e9))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return norm


def fsdp_side(model_dir: Path, device: str, pad: int) -> tuple[Any, str]:
    """The FSDP backend if it has the new interface, else :class:`HfSide`; and why."""
    try:
        from miles.backends import fsdp
    except ImportError as exc:  # mid-rewrite onto the new interface: recorded in the report
        return HfSide(model_dir, device), f"miles.backends.fsdp does not import: {exc}"
    cls = fsdp.FsdpBackend
    if not (hasattr(cls, "forward_backward") and hasattr(cls, "optimizer_step")):
        return HfSide(model_dir, device), "FsdpBackend has no forward_backward/optimizer_step yet"
    from miles.models.loading import load_policy

    model, _ = load_policy(model_dir, "float32", "cpu")
    try:
        backend = cls(model, pad, trainer_cfg("fsdp", device), 0, 1, temperature=TEMPERATURE)
    except TypeError as exc:  # the rewrite changed the constructor: say so and use the reference
        return HfSide(model_dir, device), f"FsdpBackend constructor: {exc}"
    backend.name = "fsdp"
    return backend, "FsdpBackend"


class CpuMegatronSide:
    """Dry run only: the megatron-core model on CPU, megatron's schedule emulated per micro-batch (what
    ``forward_backward_no_pipelining`` does with ``calculate_per_token_loss``), torch AdamW."""

    name = "megatron-cpu-emulated"

    def __init__(self, model_dir: Path, pad: int) -> None:
        from transformers import AutoConfig

        from miles.backends.megatron.config import translate
        from miles.backends.megatron.converters import converter_for
        from miles.backends.megatron.forward import StepOptions
        from miles.backends.megatron.hf_io import SafetensorsReader
        from miles.backends.megatron.model import build_chunks, load_hf_weights
        from miles.backends.megatron.settings import MegatronSettings

        self.args = translate(AutoConfig.from_pretrained(str(model_dir)))
        self.settings = MegatronSettings(bf16=False)
        self.converter = converter_for(self.args)
        self.chunks = build_chunks(self.args, self.settings, cpu=True)
        load_hf_weights(self.chunks, self.converter, SafetensorsReader(model_dir), self.settings, self.args)
        self.opts = StepOptions(vocab_size=self.args.vocab_size, temperature=TEMPERATURE, pad_token_id=pad)
        self.opt = torch.optim.AdamW(self.chunks[0].parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0)

    def _run(self, batches: list[Any], loss_fn: Any, entropy: bool) -> list[dict[str, Any]]:
        import dataclasses

        from miles.backends.megatron.forward import make_forward_step

        step = make_forward_step(dataclasses.replace(self.opts, entropy=entropy), loss_fn, torch.device("cpu"))
        it, store = iter(batches), []
        for _ in batches:
            output, loss_func = step(it, self.chunks[0])
            loss, _, extra = loss_func(output)
            if loss_fn is not None:
                loss.backward()
            store.append(extra)
        return store

    def score(self, batches: list[Any], entropy: bool = False) -> list[Any]:
        with torch.no_grad():
            return [item["outputs"] for item in self._run(batches, None, entropy)]

    def forward_backward(self, batches: list[Any], loss_fn: Any, entropy: bool = False) -> dict[str, float]:
        sums: dict[str, float] = {}
        for item in self._run(batches, loss_fn, entropy):
            for k, v in item["metrics"].items():
                sums[k] = sums.get(k, 0.0) + float(v)
        return sums

    def optimizer_step(self, lr: float, *, skip: bool = False) -> float:
        if skip:
            self.opt.zero_grad(set_to_none=True)
            return 0.0
        for group in self.opt.param_groups:
            group["lr"] = lr
        norm = float(torch.nn.utils.clip_grad_norm_(self.chunks[0].parameters(), 1e9))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return norm

    def export_params(self) -> Any:
        from miles.backends.megatron.export import export_hf

        return export_hf(self.chunks, self.converter, self.settings, self.args)

    def save_checkpoint(self, path: str) -> None:
        from miles.backends.megatron import checkpoint

        checkpoint.save(path, self.chunks, None, {"family": self.args.family})

    def load_checkpoint(self, path: str) -> None:
        from miles.backends.megatron import checkpoint

        checkpoint.load(path, self.chunks, None)


def megatron_side(model_dir: Path, device: str, pad: int, bf16: bool) -> Any:
    if device != "cuda":
        return CpuMegatronSide(model_dir, pad)
    from miles.backends.megatron.backend import MegatronBackend
    from miles.backends.megatron.settings import MegatronSettings

    backend = MegatronBackend(
        model_dir, pad, trainer_cfg("megatron", device), temperature=TEMPERATURE, settings=MegatronSettings(bf16=bf16)
    )
    backend.name = f"megatron-{'bf16' if bf16 else 'fp32'}"
    return backend


# --------------------------------------------------------------------------- phases


def masked(values: list[Any], batches: list[Any]) -> torch.Tensor:
    """The trained positions' values of every micro-batch, concatenated (float64, CPU)."""
    return torch.cat([v.logp.double().cpu()[mb.loss_mask.bool()] for v, mb in zip(values, batches, strict=True)])


def behaviour(batches: list[Any]) -> torch.Tensor:
    return torch.cat([mb.tensors["behaviour_logp"].double()[mb.loss_mask.bool()] for mb in batches])


def phase_gap(report: Report, batches: list[Any], ref: Any, mega32: Any, mega16: Any | None) -> None:
    engine = behaviour(batches)
    ref_lp = masked(ref.score(batches), batches)
    m32 = masked(mega32.score(batches), batches)
    values: dict[str, Any] = {
        "tokens": int(engine.numel()),
        "reference_vs_engine_mean": float((ref_lp - engine).abs().mean()),
        "megatron_fp32_vs_reference_max": float((m32 - ref_lp).abs().max()),
    }
    report.gate("megatron_fp32_vs_reference_max", values["megatron_fp32_vs_reference_max"], GATES["fp32_logp"])
    trainer = mega16 if mega16 is not None else mega32
    t_lp = masked(trainer.score(batches), batches)
    values["trainer"] = trainer.name
    values["trainer_vs_engine_mean"] = float((t_lp - engine).abs().mean())
    values["trainer_vs_engine_max"] = float((t_lp - engine).abs().max())
    report.gate("trainer_vs_engine_mean", values["trainer_vs_engine_mean"], GATES["gap_mean"])
    report.phase("gap", **values)


def one_step(side: Any, batches: list[Any], loss_fn: Any) -> tuple[float, float]:
    metrics = side.forward_backward(batches, loss_fn, entropy=True)
    return metrics["loss"], side.optimizer_step(1e-3)


def phase_parity(
    report: Report, batches: list[Any], fsdp: Any, mega32: Any, mega16: Any | None, reference: HfSide
) -> None:
    total = float(sum(mb.num_tokens for mb in batches))
    loss_fn = make_loss(total)
    f_loss, f_norm = one_step(fsdp, batches, loss_fn)
    m_loss, m_norm = one_step(mega32, batches, loss_fn)
    values: dict[str, Any] = {
        "fsdp": fsdp.name,
        "fsdp_loss": f_loss,
        "megatron_loss": m_loss,
        "loss_abs_diff": abs(m_loss - f_loss),
        "fsdp_grad_norm": f_norm,
        "megatron_grad_norm": m_norm,
        "grad_norm_rel_diff": abs(m_norm - f_norm) / max(abs(f_norm), 1e-12),
    }
    report.gate("loss_abs_diff", values["loss_abs_diff"], GATES["loss"])
    report.gate("grad_norm_rel_diff", values["grad_norm_rel_diff"], GATES["grad_norm_rel"])
    after_f = masked(fsdp.score(batches), batches)
    after_m = masked(mega32.score(batches), batches)
    values["after_step_logp_max_diff"] = float((after_m - after_f).abs().max())
    exported = {n: t for n, t in mega32.export_params() if t.numel()}
    values["exported_tensors"] = len(exported)
    values["export_vs_trainer_logp_max"] = export_check(exported, batches, after_m, reference)
    report.gate("export_vs_trainer_logp_max", values["export_vs_trainer_logp_max"], GATES["export_logp"])
    if mega16 is not None:
        b_loss, b_norm = one_step(mega16, batches, loss_fn)
        values.update(
            bf16_loss_abs_diff=abs(b_loss - f_loss), bf16_grad_norm_rel_diff=abs(b_norm - f_norm) / max(f_norm, 1e-12)
        )
    report.phase("parity", **values)


def export_check(exported: dict[str, torch.Tensor], batches: list[Any], trainer_lp: torch.Tensor, ref: HfSide) -> float:
    """The exported weights in a HF model give the trainer's log-probs (Megatron's export is its policy)."""
    model = ref.model
    missing = set(model.state_dict()) - set(exported)
    if missing:
        raise KeyError(f"export lacks {sorted(missing)[:3]}")
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.load_state_dict({k: v.to(ref.device) for k, v in exported.items()}, strict=True)
    got = masked(ref.score(batches), batches)
    model.load_state_dict(saved)
    return float((got - trainer_lp).abs().max())


def phase_checkpoint(report: Report, batches: list[Any], side: Any, out: Path) -> None:
    path = str(out / "ckpt")
    before = masked(side.score(batches), batches)
    side.save_checkpoint(path)
    one_step(side, batches, make_loss(float(sum(mb.num_tokens for mb in batches))))
    moved = float((masked(side.score(batches), batches) - before).abs().max())
    side.load_checkpoint(path)
    back = float((masked(side.score(batches), batches) - before).abs().max())
    report.gate("checkpoint_restore_logp_max", back, 1e-6)
    report.phase("checkpoint", moved_by_step=moved, after_restore_max_diff=back)


def phase_rl(report: Report, out: Path, device: str, steps: int, timeout_s: float) -> None:
    """``miles run`` of the quickstart for ``steps`` steps; megatron first, fsdp when megatron is not wired."""
    runs: dict[str, Any] = {}
    for backend in ("megatron", "fsdp"):
        run_dir = out / f"rl-{backend}"
        sets = [
            f"trainer.steps={steps}",
            "trainer.eval_every=0",
            f"rollout.engine.device={device}",
            "monitor.plots=false",
            f"trainer.backend.type={backend}",
        ]
        if backend == "fsdp":
            sets.append(f"trainer.backend.device={device}")
        cmd = [
            sys.executable,
            "-m",
            "miles.cli",
            "run",
            str(ROOT / "recipes" / "quickstart.yaml"),
            "--run-dir",
            str(run_dir),
        ]
        for s in sets:
            cmd += ["--set", s]
        start = time.time()
        try:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
            rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-1500:]
        except subprocess.TimeoutExpired as exc:
            rc, tail = 124, str(exc.stdout or "")[-1500:]
        summary = run_dir / "summary.json"
        runs[backend] = {
            "rc": rc,
            "seconds": round(time.time() - start, 1),
            "summary": json.loads(summary.read_text()) if summary.is_file() else None,
            "tail": tail if rc else "",
        }
        timeout_s -= time.time() - start
        if rc == 0 or timeout_s < 60:
            break
    if not any(r["rc"] == 0 for r in runs.values()):
        report.data["failures"].append("rl: no backend finished the quickstart steps")
    report.phase("rl", **runs)


# --------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_check"))
    parser.add_argument("--quick", action="store_true", help="short warm-up and fewer samples (dry runs)")
    parser.add_argument("--skip", action="append", default=[], choices=["checkpoint", "rl"])
    parser.add_argument("--rl-steps", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=450.0, help="stop starting phases after this")
    args = parser.parse_args()
    start = time.time()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XDG_CACHE_HOME", str(out / "cache"))  # the RL run reuses the built model
    report = Report(out / "gpu_check.json")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no GPU")
    import megatron.core

    report.phase(
        "environment",
        torch=torch.__version__,
        cuda=torch.version.cuda,
        gpu=torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        megatron_core=megatron.core.__version__,
        python=sys.version.split()[0],
    )
    model_dir, cfg, tokenizer = build_model(out, args.quick)
    report.phase("model", dir=str(model_dir), seconds=round(time.time() - start, 1))
    gens = sample(model_dir, cfg, tokenizer, args.device, 16 if args.quick else 64)
    batches = pack(gens, seqs_per_row=2, rows=4, pad=tokenizer.pad_token_id, seed=0)
    report.phase("engine", generations=len(gens), micro_batches=len(batches))

    from miles.backends.distributed import init_distributed
    from miles.ports import free_port

    init_distributed(0, 1, "127.0.0.1", free_port(), device=args.device)
    shims = None
    if args.device == "cpu":
        from megatron.core import parallel_state as ps

        from miles.backends.megatron.cpu_shims import cpu_megatron

        ps.initialize_model_parallel(1, 1)
        shims = cpu_megatron()
        shims.__enter__()
    pad = tokenizer.pad_token_id
    reference = HfSide(model_dir, args.device)
    mega32 = megatron_side(model_dir, args.device, pad, bf16=False)
    mega16 = megatron_side(model_dir, args.device, pad, bf16=True) if args.device == "cuda" else None
    phase_gap(report, batches, reference, mega32, mega16)
    fsdp, why = fsdp_side(model_dir, args.device, pad)
    report.data["fsdp_side"] = why
    phase_parity(report, batches, fsdp, mega32, mega16, reference)
    if "checkpoint" not in args.skip:
        phase_checkpoint(report, batches, mega32, out)
    if shims is not None:
        shims.__exit__(None, None, None)
    left = args.budget_s - (time.time() - start)
    if "rl" not in args.skip and left > 60:
        phase_rl(report, out, args.device, args.rl_steps, left)
    elif "rl" not in args.skip:
        report.data["failures"].append(f"rl: skipped, only {left:.0f}s of the budget left")
    report.phase("done", seconds=round(time.time() - start, 1), failures=report.data["failures"])
    return 1 if report.data["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
