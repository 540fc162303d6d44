"""The frozen teacher of on-policy distillation: where it is, that it is not the student, and its log-probs.

A teacher is named by a path (``trainer.algo.distill.teacher.path``):

* a Hugging Face checkpoint directory (``config.json`` and weights), or
* a Miles run directory (``config.yaml`` and ``checkpoints/``): the newest *complete* checkpoint of that run,
  loaded into the architecture of the model that run started from (prepared on this machine). This is how
  phase 2 of self-distillation names the teacher phase 1 trained.

Nothing falls back: a path that is neither is refused, and so is a teacher whose tokenizer differs from the
student's (its log-probs would be of other tokens) or **whose weights equal the student's** (the reverse-KL
term would be exactly 0 and nothing would be distilled; the reference recipe's documented pitfall is a
mis-set teacher path silently falling back to the student). :func:`check_teacher` runs in ``miles
prepare``/``miles run`` before anything starts and again in every trainer process; both report one line and
exit 2.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from miles.backends.base import MicroBatch

log = structlog.get_logger(__name__)


class TeacherError(ValueError):
    """The configured teacher cannot be used; the message is one line naming the path and the reason."""


@dataclass(frozen=True, slots=True)
class TeacherSource:
    """A resolved teacher: ``model_dir`` holds its config.json and tokenizer; ``checkpoint`` (a run's
    newest complete DCP checkpoint) its weights, or None when they are in ``model_dir`` itself."""

    path: Path
    model_dir: Path
    checkpoint: Path | None = None

    def describe(self) -> str:
        return str(self.checkpoint or self.model_dir)


def resolve_teacher(path: str) -> TeacherSource:
    """Where a teacher path's architecture, tokenizer and weights are; :class:`TeacherError` if nowhere."""
    root = Path(path).expanduser()
    what = f"trainer.algo.distill.teacher.path {str(root)!r}"
    if not root.is_dir():
        raise TeacherError(f"{what} is not a directory (nothing falls back to the student)")
    if (root / "config.json").is_file():
        return TeacherSource(root, root)
    if (root / "config.yaml").is_file():
        return _run_teacher(root, what)
    raise TeacherError(f"{what} is neither a Hugging Face checkpoint (config.json) nor a Miles run (config.yaml)")


def _run_teacher(run_dir: Path, what: str) -> TeacherSource:
    from miles.config import ConfigError, load_config
    from miles.models.loading import ModelNotFoundError, ModelNotPrepared, prepared_model_dir
    from miles.training.checkpoint import CheckpointManager

    try:
        run_cfg = load_config(run_dir / "config.yaml")
    except ConfigError as exc:
        raise TeacherError(f"{what}: {exc}") from None
    if run_cfg.trainer.lora is not None:
        raise TeacherError(f"{what}: a LoRA run's checkpoints hold only adapters; export merged weights first")
    if run_cfg.trainer.backend.type != "fsdp":
        raise TeacherError(f"{what}: only fsdp runs' checkpoints can be loaded as a teacher")
    try:
        model_dir = prepared_model_dir(run_cfg.model, run_cfg.task)
    except (ModelNotFoundError, ModelNotPrepared) as exc:
        raise TeacherError(f"{what}: the teacher run's model: {exc}") from None
    latest = CheckpointManager(run_dir / "checkpoints", every=1, keep=1).latest()
    if latest is None:
        raise TeacherError(f"{what}: the run has no complete checkpoint under checkpoints/")
    return TeacherSource(run_dir, model_dir, latest[0])


def _as_checkpointed(model: nn.Module) -> nn.Module:
    """A module whose state-dict names match a trainer checkpoint's (``lm.<HF name>``: the backend's
    :class:`~miles.backends.fsdp.TokenScorer` holds the model as ``lm``)."""
    from torch import nn

    holder = nn.Module()
    holder.lm = model
    return holder


def load_teacher_model(source: TeacherSource, device: str = "cpu") -> Any:
    """The teacher as an HF causal LM in float32 on ``device``, eval mode, no gradients."""
    from miles.models.loading import load_policy

    model, _ = load_policy(source.model_dir, "float32", "cpu")
    if source.checkpoint is not None:
        _load_checkpoint_weights(model, source.checkpoint)
    model.requires_grad_(False)
    return model.to(device).eval()


def _load_checkpoint_weights(model: nn.Module, checkpoint: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    holder = _as_checkpointed(model)
    state = {"model": get_model_state_dict(holder)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            # Every rank reads the whole teacher (it is not sharded): no collective, no process group.
            dcp.load(state, storage_reader=FileSystemReader(checkpoint), no_dist=True)
        except Exception as exc:  # a checkpoint of another architecture: say which, in one line
            raise TeacherError(f"teacher checkpoint {checkpoint}: cannot load its weights ({exc})") from None
    set_model_state_dict(holder, state["model"])


def _safetensors_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


def _lazy_tensors(model_dir: Path) -> dict[str, tuple[Path, str]] | None:
    """name -> (file, name) of every tensor in a checkpoint's safetensors files; None if it has none."""
    from safetensors import safe_open

    files = _safetensors_files(model_dir)
    if not files:
        return None
    out: dict[str, tuple[Path, str]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[name] = (file, name)
    return out


def _read(entry: tuple[Path, str]) -> Tensor:
    from safetensors import safe_open

    with safe_open(str(entry[0]), framework="pt") as f:
        return f.get_tensor(entry[1])


def _state_items(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from model.state_dict().items()


def same_weights(source: TeacherSource, student_dir: Path) -> bool:
    """Whether the teacher's weights equal the student's, bit for bit.

    Two safetensors checkpoints are compared tensor by tensor, stopping at the first difference (so a real
    teacher costs one tensor read); otherwise both models are loaded and their state dicts compared."""
    import torch

    if source.checkpoint is None:
        teacher, student = _lazy_tensors(source.model_dir), _lazy_tensors(student_dir)
        if teacher is not None and student is not None:
            if set(teacher) != set(student):
                return False
            return all(torch.equal(_read(teacher[name]), _read(student[name])) for name in sorted(teacher))
    from miles.models.loading import load_policy

    teacher_model = load_teacher_model(source)
    student_model, _ = load_policy(student_dir, "float32", "cpu")
    mine = dict(_state_items(student_model))
    theirs = dict(_state_items(teacher_model))
    if set(mine) != set(theirs):
        return False
    return all(mine[k].shape == theirs[k].shape and torch.equal(mine[k], theirs[k]) for k in sorted(mine))


def check_teacher(teacher_path: str, student_dir: Path) -> TeacherSource:
    """Resolve the teacher and refuse it if it cannot be distilled from (:class:`TeacherError`, one line)."""
    from miles.models.loading import load_tokenizer

    source = resolve_teacher(teacher_path)
    what = f"trainer.algo.distill.teacher.path {str(source.path)!r}"
    if source.checkpoint is None and source.model_dir.resolve() == Path(student_dir).resolve():
        raise TeacherError(f"{what} is the student's own model directory: nothing would be distilled")
    try:
        teacher_vocab = load_tokenizer(source.model_dir).get_vocab()
    except Exception as exc:  # a checkpoint without tokenizer files: name it
        raise TeacherError(f"{what}: cannot load its tokenizer ({exc.__class__.__name__}: {exc})") from None
    if teacher_vocab != load_tokenizer(student_dir).get_vocab():
        raise TeacherError(f"{what}: its tokenizer differs from the student's (log-probs would be of other tokens)")
    if same_weights(source, Path(student_dir)):
        raise TeacherError(
            f"{what}: the teacher's weights ({source.describe()}) equal the student's: the reverse-KL term would be "
            "0 and nothing would be distilled"
        )
    log.info("teacher_checked", teacher=source.describe(), student=str(student_dir))
    return source


class TeacherScorer:
    """A frozen teacher in the trainer: per-token log-probs of a micro-batch's targets, without gradients.

    Every trainer rank holds the whole teacher (unsharded) and scores only its own micro-batches; the
    log-probs are computed like the student's (chunked, at the rollout temperature), so a teacher equal to the
    student would give exactly the student's log-probs. For a teacher too large to replicate, use a teacher
    engine on the bus (``teacher.type: actor``).
    """

    def __init__(self, model: Any, *, temperature: float, chunk_tokens: int, device: str = "cpu") -> None:
        from miles.backends.fsdp import TokenScorer

        self.device = device
        self.scorer = TokenScorer(model, temperature=temperature, chunk_tokens=chunk_tokens).to(device).eval()

    def score(self, mb: MicroBatch, temperature: float | None = None) -> torch.Tensor:
        """``(R, L)`` float32 log-probs of ``mb.targets`` under the teacher (at ``temperature``, default the
        one it was built with)."""
        import torch

        if temperature is not None:
            self.scorer.temperature = float(temperature)
        dev = self.device
        with torch.no_grad():  # the teacher may sit on another device than the micro-batch (a CPU teacher)
            out = self.scorer(mb.input_ids.to(dev), mb.position_ids.to(dev), mb.targets.to(dev), False).logp
        return out.to(mb.input_ids.device)


def build_trainer_teacher(cfg: Any) -> TeacherScorer | None:
    """The trainer-side teacher of a run config (``trainer.algo.distill.teacher.type: in_trainer``), checked
    against the student (the run's prepared model); None when the run distills from a bus teacher or not at all."""
    from miles.models.loading import prepared_model_dir

    distill = cfg.trainer.algo.distill
    if distill is None or distill.teacher.type != "in_trainer":
        return None
    source = check_teacher(distill.teacher.path, prepared_model_dir(cfg.model, cfg.task))
    backend = cfg.trainer.backend
    device = getattr(backend, "device", None) or ("cuda" if backend.type == "megatron" else "cpu")
    chunk = int(getattr(cfg.trainer.backend, "logprob_chunk_tokens", 1024))
    temperature = cfg.rollout.sampling.temperature or 1.0  # greedy rollouts: log-probs at T=1, like the student's
    model = load_teacher_model(source, device)
    log.info("teacher_loaded", teacher=source.describe(), device=device)
    return TeacherScorer(model, temperature=temperature, chunk_tokens=chunk, device=device)
