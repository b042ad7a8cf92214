"""A model call (the target's or a draft head's) survives packing into one int64 tensor
(step_sync.StepMessage)."""
from __future__ import annotations

import pytest
import torch

from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.parallel.step_sync import HEAD, TARGET, StepMessage


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


def test_tree_masks_roundtrip_per_request():
    """A verify pass over two trees (m = q_len) and a causal request; a draft-tree step whose
    mask also covers earlier scratch entries (m > q_len)."""
    g = torch.Generator().manual_seed(0)
    masks = [torch.rand(3, 3, generator=g) > 0.5, None, torch.rand(2, 5, generator=g) > 0.5]
    layout = BatchLayout(q_lens=[3, 1, 2], kv_lens=[7, 4, 6], block_tables=[[0, 1], [2], [3, 5]],
                         page_size=4, positions=torch.tensor([6, 7, 7, 3, 5, 5]), tree_masks=masks)
    got = _roundtrip(StepMessage(torch.arange(6), layout, None, True, ()))
    assert got.layout.tree_masks[1] is None
    for want, have in zip((masks[0], masks[2]), (got.layout.tree_masks[0], got.layout.tree_masks[2])):
        assert have.dtype == torch.bool and torch.equal(have, want)
    assert got.layout.positions.tolist() == [6, 7, 7, 3, 5, 5]
    assert got.layout.block_tables == [[0, 1], [2], [3, 5]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_head_call_carries_its_state_bit_for_bit(dtype):
    """The float state rides in the int64 buffer bit-cast (odd sizes padded to whole words)."""
    state = torch.randn(3, 5, generator=torch.Generator().manual_seed(1)).to(dtype)
    state[0, 0] = float("nan")
    layout = BatchLayout(q_lens=[1, 2], kv_lens=[5, 6], block_tables=[[1, 2], [3, 4]], page_size=4)
    msg = StepMessage(torch.tensor([7, 8, 9]), layout, torch.tensor([0, 2]), True, (),
                      model=HEAD, state=state, k=3)
    got = _roundtrip(msg)
    assert got.model == HEAD and got.k == 3 and got.state.dtype == dtype
    assert torch.equal(got.state.view(torch.uint8), state.view(torch.uint8))
    assert got.logits_indices.tolist() == [0, 2] and got.input_ids.tolist() == [7, 8, 9]
    assert _roundtrip(StepMessage(torch.tensor([1]), layout, None, True, ())).model == TARGET


def test_medusa_call_has_no_layout_and_moves_ride_along():
    state = torch.randn(2, 4)
    moves = (torch.tensor([9, 10]), torch.tensor([5, 6]))
    got = _roundtrip(StepMessage(torch.tensor([3, 4]), None, None, True, (), model=HEAD,
                                 state=state, k=2, moves=moves))
    assert got.layout is None and torch.equal(got.state, state)
    assert [m.tolist() for m in got.moves] == [[9, 10], [5, 6]]
    assert _roundtrip(StepMessage(torch.tensor([3]), None, None, True, ())).moves is None


def test_cacheless_packed_prefill_roundtrips_without_tables():
    layout = BatchLayout.packed([3, 2])
    got = _roundtrip(StepMessage(torch.tensor([1, 2, 3, 4, 5]), layout, None, False, (1,)))
    assert got.layout.block_tables is None
    assert got.layout.q_lens == [3, 2] and got.layout.kv_lens == [3, 2]
    assert got.input_ids.tolist() == [1, 2, 3, 4, 5] and got.aux_layers == (1,)
