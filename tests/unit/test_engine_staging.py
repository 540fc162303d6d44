"""The staging rules and the newest-wins slot the SGLang and vLLM engines share (miles/engines/staging.py)."""

from __future__ import annotations

import pytest
import torch

from miles.config import LoraConfig
from miles.engines.base import SparseValues
from miles.engines.staging import StagedSlot, whole_state


def test_the_slot_keeps_the_newest_and_retries_only_when_nothing_newer_came() -> None:
    slot, a, b = StagedSlot(), {"w": torch.zeros(1)}, {"w": torch.ones(1)}
    assert not slot.offer(3, a, running=3)  # not newer than what the engine runs
    assert slot.offer(4, a, running=3) and slot.offer(5, b, running=3) and not slot.offer(4, a, running=3)
    assert slot.pending == 5
    version, tensors = slot.take() or (None, None)
    assert version == 5 and tensors is b and slot.pending == 5 and slot.take() is None
    assert not slot.offer(5, a, running=3)  # being loaded
    slot.done()
    slot.retry(5, b)  # the load failed: back in the slot
    assert slot.pending == 5
    slot.take()
    assert slot.offer(6, a, running=3)
    slot.retry(5, b)  # a newer one came meanwhile: the failed one stays out
    assert slot.pending == 6
    slot.clear()
    assert slot.take() is None


def test_whole_state_declines_the_delta_fast_path_and_refuses_what_a_file_cannot_hold() -> None:
    full = {"w": torch.zeros(2)}
    sparse = {"w": SparseValues(torch.tensor([0]), torch.tensor([1.0]))}
    assert whole_state(full, server="X", lora=None, base_version=None, complete=True) == full
    assert whole_state(sparse, server="X", lora=None, base_version=1, complete=False) is None
    with pytest.raises(ValueError, match="X loads whole tensors; 1 sparse update"):
        whole_state(sparse, server="X", lora=None, base_version=None, complete=False)
    with pytest.raises(ValueError, match="empty state"):
        whole_state({}, server="X", lora=None, base_version=None, complete=True)
    with pytest.raises(ValueError, match="X reloads whole states"):
        whole_state(full, server="X", lora=None, base_version=None, complete=False)
    with pytest.raises(ValueError):  # not a peft adapter of trainer.lora's shape
        whole_state(full, server="X", lora=LoraConfig(rank=4), base_version=None, complete=False)
