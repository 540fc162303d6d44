"""Torch-free config of terminal tasks: Harbor task folders, or the built-in family generated offline."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from miles.config_base import Strict, TaskBase


class BuiltinTerminalConfig(Strict):
    """The built-in family (:mod:`miles.tasks.terminal.builtin`): read a number from a file, write it transformed."""

    transform: Literal["copy", "add", "reverse"] = Field(
        "copy", description="What to write: the number, +add, reversed."
    )
    add: int = Field(3, description="The constant of the 'add' transform.")
    digits: int = Field(3, ge=1, le=9, description="Digits of the number in the file.")
    vary_names: bool = Field(False, description="Draw the two file names per task (else always 'v' and 'a').")
    disjoint_names: bool = Field(
        False, description="With vary_names: train names from a-m, eval names from n-z (tests reading names)."
    )
    guess_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Share of training tasks whose warm-up demonstration writes a placeholder (0) without "
        "looking at the file (it earns 0): the warmed-up model sometimes looks and sometimes guesses, and RL "
        "must learn from the reward that looking pays. Eval tasks and the verifier are unchanged.",
    )
    train_size: int = Field(512, gt=0, description="Number of training task folders.")
    eval_size: int = Field(64, gt=0, description="Number of held-out task folders (numbers disjoint from train).")
    seed: int = Field(0, description="Seed of the generator.")

    @model_validator(mode="after")
    def _names_need_variation(self) -> BuiltinTerminalConfig:
        if self.disjoint_names and not self.vary_names:
            raise ValueError("disjoint_names needs vary_names: true")
        return self


class TerminalTaskConfig(TaskBase):
    """Terminal tasks played in a sandbox: Harbor folders (train_dir, eval_dir) or the built-in family."""

    type: Literal["terminal"] = "terminal"
    train_dir: str | None = Field(None, description="Directory of Harbor task folders for training.")
    eval_dir: str | None = Field(None, description="Directory of Harbor task folders held out for eval.")
    builtin: BuiltinTerminalConfig | None = Field(
        None, description="Generate the built-in family instead (into the run directory, once, before actors start)."
    )
    system_prompt: str | None = Field(None, description="Optional system message before each instruction.")
    observation_chars: int = Field(512, gt=0, description="Characters of command output shown to the agent per turn.")
    observation_role: Literal["user", "tool"] = Field("user", description="Role of the output messages.")

    @model_validator(mode="after")
    def _one_source(self) -> TerminalTaskConfig:
        folders = self.train_dir is not None and self.eval_dir is not None
        if folders == (self.builtin is not None) or (self.train_dir is None) != (self.eval_dir is None):
            raise ValueError("terminal task: set either train_dir and eval_dir, or builtin")
        return self
