"""A step's model call survives packing into one int64 tensor (step_sync.StepMessage)."""
from __future__ import annotations

import pytest
import torch

from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.parallel.step_sync import StepMessage


def _roundtrip(msg: StepMessage) -> StepMessage:
    flat = msg.pack()
    assert flat.dtype == torch.long and int(flat[0]) == flat.numel()
    padded = torch.cat([flat, torch.full((7,), -9)])  # the channel's buffer is larger
    return StepMessage.unpack(padded[:int(padded[0])], torch.device("cpu"))


def test_prefill_and_decode_rows_roundtrip():
    layout = BatchLayout(q_lens=[1, 3], kv_lens=[6, 3], block_tables=[[4, 9], [2]], page_size=4)
    msg = StepMessage(torch.tensor([11, 12, 13, 14]), layout, torch.tensor([0, 3]), True, (0, 2))
    got = _roundtrip(msg)
    assert got.input_ids.tolist() == [11, 12, 13, 14]
    assert (got.layout.q_lens, got.layout.kv_lens) == ([1, 3], [6, 3])
    assert got.layout.block_tables == [[4, 9], [2]] and got.layout.page_size == 4
    assert got.logits_indices.tolist() == [0, 3]
    assert got.compute_logits and got.aux_layers == (0, 2)
    assert got.layout.positions is None
    assert got.layout.slot_mapping().tolist() == layout.slot_mapping().tolist()


def test_all_rows_and_explicit_positions_roundtrip():
    layout = BatchLayout(q_lens=[2], kv_lens=[5], block_tables=[[7, 1]], page_size=4,
                         positions=torch.tensor([3, 3]))
    got = _roundtrip(StepMessage(torch.tensor([5, 6]), layout, None, False, ()))
    assert got.logits_indices is None and not got.compute_logits and got.aux_layers == ()
    assert got.layout.positions.tolist() == [3, 3]


def test_tree_masks_are_refused_by_name():
    layout = BatchLayout(q_lens=[2], kv_lens=[2], block_tables=[[0]], page_size=4,
                         tree_masks=[torch.ones(2, 2, dtype=torch.bool)])
    with pytest.raises(NotImplementedError, match="tree masks under engine.tensor_parallel"):
        StepMessage(torch.tensor([1, 2]), layout, None, True, ()).pack()
