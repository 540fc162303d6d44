"""LoRA adapters on disk in peft's format, the one ``PeftModel.from_pretrained`` and SGLang's
``/load_lora_adapter`` read.

A directory holds two files:

* ``adapter_config.json``: ``peft_type`` ``"LORA"``, ``task_type`` ``"CAUSAL_LM"``, ``r``, ``lora_alpha``,
  ``target_modules``, ``lora_dropout`` 0, ``bias`` ``"none"``, ``base_model_name_or_path``,
  ``fan_in_fan_out`` false and ``inference_mode`` true (peft fills in defaults for the rest).
* ``adapter_model.safetensors``: the tensors under peft's *saved-state* names, i.e. what
  ``peft.get_peft_model_state_dict(model)`` returns and ``save_pretrained`` writes, such as
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` (no ``.default`` adapter name in
  the key; ``lora_A`` is ``(r, in_features)``, ``lora_B`` is ``(out_features, r)``).

:func:`save_peft_adapter` writes the directory under a temporary name next to the target and renames it
into place, so a server that is told the path only ever sees a complete adapter.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.config import LoraConfig

if TYPE_CHECKING:
    import torch

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"

# peft's saved-state key: base_model.model.<module path>.lora_{A,B}.weight
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def adapter_config(lora: LoraConfig, base_model: str = "") -> dict[str, Any]:
    """The ``adapter_config.json`` content for ``lora`` (a plain LoRA on a causal LM)."""
    alpha = lora.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "target_modules": list(lora.target_modules),
        "lora_dropout": 0.0,
        "bias": "none",
        "base_model_name_or_path": base_model,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def _targeted(module: str, targets: list[str]) -> bool:
    """peft's rule for a list of target names: the module path equals a target or ends with ``.<target>``."""
    return any(module == t or module.endswith("." + t) for t in targets)


def validate_adapter(adapter: Mapping[str, torch.Tensor], lora: LoraConfig) -> None:
    if not adapter:
        raise ValueError("cannot save an empty LoRA adapter: no tensors given")
    bad = [k for k in adapter if not _KEY.match(k)]
    if bad:
        shown = ", ".join(repr(k) for k in sorted(bad)[:3]) + (f" (+{len(bad) - 3} more)" if len(bad) > 3 else "")
        raise ValueError(
            f"{len(bad)} adapter key(s) are not peft LoRA keys of the form "
            f"'base_model.model.<module>.lora_A.weight' / '.lora_B.weight': {shown}. Pass "
            "peft.get_peft_model_state_dict(model), not model.state_dict() or named_parameters()"
        )
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapter.items():
        m = _KEY.match(key)
        assert m is not None
        pairs.setdefault(m["module"], {})[m["ab"]] = tensor
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            missing = ({"A", "B"} - set(ab)).pop()
            raise ValueError(f"LoRA adapter for {module!r} has no lora_{missing} tensor")
        if not _targeted(module, lora.target_modules):
            raise ValueError(f"LoRA adapter has tensors for {module!r}, not in target_modules {lora.target_modules}")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != lora.rank or b.shape[1] != lora.rank:
            raise ValueError(
                f"LoRA tensors for {module!r} have shapes A {tuple(a.shape)}, B {tuple(b.shape)}; "
                f"expected A (r, in) and B (out, r) with r = {lora.rank}"
            )


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_dir_atomically(target: Path, fill: Callable[[Path], None]) -> None:
    """Create directory ``target`` with ``fill(tmp)`` writing into a temporary sibling, then rename it into
    place. An existing ``target`` is moved aside first and restored if anything fails, so a reader (an
    SGLang server) sees the old directory, the new one, or briefly none, never a half-written one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    old: Path | None = None
    tmp.mkdir()
    try:
        fill(tmp)
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(target, old)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not target.exists():
            os.replace(old, target)  # put the previous directory back
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_peft_adapter(
    adapter: Mapping[str, torch.Tensor], lora: LoraConfig, directory: str | Path, *, base_model: str = ""
) -> Path:
    """Write ``adapter`` (peft saved-state keys, see the module docstring) as a peft adapter directory.

    The files are written to a temporary sibling directory and renamed to ``directory`` once complete;
    an existing ``directory`` is replaced (it is moved aside first, so a reader sees either the old or the
    new adapter, or, briefly, none). Tensors are copied to CPU and keep their dtype. Raises ``ValueError``
    for an empty adapter, non-LoRA keys, a missing A/B half, a module outside ``lora.target_modules`` or
    a rank other than ``lora.rank``. Returns the directory.
    """
    from safetensors.torch import save_file

    validate_adapter(adapter, lora)
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter.items()}
    config = json.dumps(adapter_config(lora, base_model), indent=2, sort_keys=True) + "\n"

    def fill(tmp: Path) -> None:
        (tmp / CONFIG_NAME).write_text(config)
        save_file(tensors, tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            fsync_file(tmp / name)

    write_dir_atomically(target, fill)
    return target


def load_peft_adapter(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors (peft saved-state keys, on CPU) and the parsed ``adapter_config.json`` of a peft adapter."""
    from safetensors.torch import load_file

    path = Path(directory)
    config_path, weights_path = path / CONFIG_NAME, path / WEIGHTS_NAME
    for p in (config_path, weights_path):
        if not p.is_file():
            raise FileNotFoundError(f"{path} is not a peft adapter directory: {p.name} is missing")
    config = json.loads(config_path.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{config_path}: peft_type is {config.get('peft_type')!r}, expected 'LORA'")
    return load_file(weights_path), config
