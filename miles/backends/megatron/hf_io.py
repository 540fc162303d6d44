"""Reading a HF checkpoint one tensor at a time (no rank loads the whole model into memory)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


class SafetensorsReader:
    """``reader(name)`` -> that tensor, from ``model.safetensors`` or a sharded
    ``model.safetensors.index.json`` checkpoint; files are memory-mapped and opened on first use."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            self.files: dict[str, str] = dict(json.loads(index.read_text())["weight_map"])
        elif (self.dir / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(str(self.dir / "model.safetensors"), "pt") as f:
                self.files = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.dir}: no model.safetensors(.index.json) (Megatron loads safetensors)")
        self._open: dict[str, Any] = {}

    def names(self) -> list[str]:
        return sorted(self.files)

    def __call__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file = self.files.get(name)
        if file is None:
            raise KeyError(f"{name}: not in the checkpoint at {self.dir}")
        handle = self._open.get(file)
        if handle is None:
            handle = self._open[file] = safe_open(str(self.dir / file), "pt")
        return handle.get_tensor(name)
