"""FlashInfer backend: metadata and masks on CPU (hand-worked), kernels against torch on CUDA."""
from __future__ import annotations

import copy

import pytest
import torch

from inference_eval.engine.attention.flashinfer_backend import (
    available, check_dtypes, paged_kv_metadata, tree_custom_mask)
from inference_eval.engine.attention.layout import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionPlan
from inference_eval.engine.kv_cache import KVCache


def _as_lists(meta: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    assert all(t.dtype == torch.int32 and t.device.type == "cpu" for t in meta.values())
    return {k: t.tolist() for k, t in meta.items()}


# ---- paged_kv_metadata --------------------------------------------------------------------

def test_paged_metadata_worked_example():
    # page_size 4. A: 5 cached + 1 new (kv 6) in pages [7, 2], page 9 allocated but unused.
    # B: fresh prompt of 3 in page [4]. C: 6 cached + 2 new (kv 8) fills pages [5, 6] exactly.
    layout = BatchLayout(q_lens=[1, 3, 2], kv_lens=[6, 3, 8],
                         block_tables=[[7, 2, 9], [4], [5, 6]], page_size=4)
    assert _as_lists(paged_kv_metadata(layout)) == {
        "qo_indptr": [0, 1, 4, 6],
        "paged_kv_indptr": [0, 2, 3, 5],
        "paged_kv_indices": [7, 2, 4, 5, 6],
        "paged_kv_last_page_len": [2, 3, 4],  # a full page counts 4, never 0
    }


def test_paged_metadata_decode_batch():
    layout = BatchLayout(q_lens=[1, 1, 1], kv_lens=[1, 16, 17],
                         block_tables=[[3], [0], [1, 8]], page_size=16)
    assert _as_lists(paged_kv_metadata(layout)) == {
        "qo_indptr": [0, 1, 2, 3],
        "paged_kv_indptr": [0, 1, 2, 4],
        "paged_kv_indices": [3, 0, 1, 8],
        "paged_kv_last_page_len": [1, 16, 1],
    }


def test_paged_metadata_rejects_short_table_and_cacheless():
    with pytest.raises(ValueError, match="request 1: kv_len 9 needs 3 pages"):
        paged_kv_metadata(BatchLayout([1, 1], [2, 9], [[0], [1, 2]], page_size=4))
    with pytest.raises(ValueError, match="needs block_tables"):
        paged_kv_metadata(BatchLayout.packed([3, 4]))


def test_paged_metadata_matches_slot_mapping():
    """Every new token's slot lies in the pages the metadata lists, at the right offset."""
    layout = BatchLayout(q_lens=[3, 1, 5], kv_lens=[10, 4, 5],
                         block_tables=[[11, 3, 6, 0], [2], [9, 1]], page_size=4)
    meta = paged_kv_metadata(layout)
    indptr, idx = meta["paged_kv_indptr"].tolist(), meta["paged_kv_indices"].tolist()
    slots = layout.slot_mapping().tolist()
    for b, r in enumerate(layout.cache_indices()):
        pages = idx[indptr[b]:indptr[b + 1]]
        want = [pages[i // 4] * 4 + i % 4 for i in r]
        assert slots[layout.cu_q()[b]:layout.cu_q()[b + 1]] == want


# ---- tree_custom_mask ---------------------------------------------------------------------

def test_tree_mask_worked_example():
    # A: 2 cached keys + a 3-token tree (root, two children of root); B: 2 new tokens, causal.
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    layout = BatchLayout(q_lens=[3, 2], kv_lens=[5, 2], block_tables=[[0, 1], [2]],
                         page_size=4, tree_masks=[tree, None])
    want = [1, 1, 1, 0, 0,
            1, 1, 1, 1, 0,
            1, 1, 1, 0, 1,   # child 2 does not see child 1
            1, 0,
            1, 1]
    got = tree_custom_mask(layout)
    assert got.dtype == torch.bool and got.shape == (3 * 5 + 2 * 2,)
    assert got.int().tolist() == want


def test_tree_mask_none_without_trees_and_shape_checked():
    assert tree_custom_mask(BatchLayout([1, 2], [4, 2], [[0], [1]], page_size=4)) is None
    for shape in ((3, 3), (2, 6), (2, 1)):
        with pytest.raises(ValueError, match=r"request 0: tree mask has shape \(%d, %d\), "
                           r"expected \(2, m\) with 2 <= m <= 5" % shape):
            BatchLayout([2], [5], [[0, 1]], page_size=4, tree_masks=[torch.ones(*shape, dtype=torch.bool)])


def test_wide_tree_mask_covers_the_last_m_keys():
    # 2 prefix keys fully visible, then 4 masked keys: 2 scratch entries + the 2 new tokens.
    tm = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    layout = BatchLayout([2], [6], [[0, 1]], page_size=4, tree_masks=[tm])
    want = [[1, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 1]]
    assert tree_custom_mask(layout).view(2, 6).int().tolist() == want
    ref = TorchAttentionPlan(layout, torch.device("cpu")).mask[0, 0]
    assert ref.int().tolist() == want


def test_tree_mask_matches_torch_backend_mask():
    """The flat mask equals the torch backend's padded mask, request by request."""
    g = torch.Generator().manual_seed(0)
    q_lens, kv_lens = [4, 1, 3, 5], [9, 7, 3, 5]
    trees = []
    for q in q_lens:
        m = torch.rand(q, q, generator=g) < 0.5
        trees.append((m.tril() | torch.eye(q, dtype=torch.bool)) if q != 3 else None)
    layout = BatchLayout(q_lens, kv_lens, [[0, 1, 2], [3, 4], [5], [6, 7]], page_size=4,
                         tree_masks=trees)
    ref = TorchAttentionPlan(layout, torch.device("cpu")).mask[:, 0]
    flat, start = tree_custom_mask(layout), 0
    for b, (q, kv) in enumerate(zip(q_lens, kv_lens)):
        assert torch.equal(flat[start:start + q * kv].view(q, kv), ref[b, :q, :kv])
        start += q * kv
    assert start == flat.numel()


def test_check_dtypes_names_the_fix():
    q = torch.zeros(2, 4, 8)
    with pytest.raises(ValueError, match="target.dtype=bfloat16"):
        check_dtypes(q, q[:, :2], torch.float32)
    qb = q.bfloat16()
    with pytest.raises(ValueError, match="share one dtype"):
        check_dtypes(qb, qb[:, :2], torch.float16)
    check_dtypes(qb, qb[:, :2], torch.bfloat16)


# ---- CUDA parity --------------------------------------------------------------------------

HEAD_DIM, PAGE = 128, 16
TREE = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
WIDE = torch.tensor([[0, 1, 0, 1, 1, 0], [1, 0, 1, 0, 0, 1]], dtype=torch.bool)


def _layouts() -> dict[str, BatchLayout]:
    return {
        "decode": BatchLayout([1, 1, 1], [1, 37, 16], [[4], [0, 9, 2], [7]], PAGE),
        "mixed": BatchLayout([1, 23, 3], [40, 23, 19], [[1, 5, 8], [3, 6], [2, 0]], PAGE),
        "tree": BatchLayout([4, 2], [21, 30], [[3, 1], [0, 4]], PAGE, tree_masks=[TREE, None],
                            positions=torch.tensor([17, 18, 18, 19, 28, 29])),
        "packed": BatchLayout.packed([9, 1, 33]),
        # Draft-tree construction: 2 frontier nodes over 6 masked keys (scratch + themselves).
        "wide_tree": BatchLayout([2, 2], [26, 14], [[3, 1], [0]], PAGE,
                                 tree_masks=[WIDE, WIDE[:, 2:]],
                                 positions=torch.tensor([22, 22, 12, 12])),
    }


@pytest.mark.gpu
@pytest.mark.skipif(not available(), reason="FlashInfer backend needs CUDA and flashinfer-python")
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("case", ["decode", "mixed", "tree", "packed", "wide_tree"])
def test_flashinfer_matches_torch(case, heads, kv_heads):
    from inference_eval.engine.attention.flashinfer_backend import FlashInferBackend
    from inference_eval.engine.attention.torch_backend import TorchAttentionBackend

    dev, dt = torch.device("cuda"), torch.bfloat16
    layout = _layouts()[case]
    g = torch.Generator(device=dev).manual_seed(0)
    cached = layout.block_tables is not None
    ref_cache = fi_cache = None
    if cached:
        ref_cache = KVCache(2, 10, PAGE, kv_heads, HEAD_DIM, dt, dev)
        ref_cache.k.normal_(generator=g)
        ref_cache.v.normal_(generator=g)
        fi_cache = copy.deepcopy(ref_cache)
    fi_plan = FlashInferBackend(dev).plan(layout)
    ref_plan = TorchAttentionBackend(dev).plan(layout)
    assert fi_plan.num_tokens == layout.num_tokens
    assert torch.equal(fi_plan.positions, ref_plan.positions)
    t = layout.num_tokens
    for layer in range(2):  # the second layer reuses the first layer's planning
        q = torch.randn(t, heads, HEAD_DIM, generator=g, device=dev, dtype=dt)
        k = torch.randn(t, kv_heads, HEAD_DIM, generator=g, device=dev, dtype=dt)
        v = torch.randn(t, kv_heads, HEAD_DIM, generator=g, device=dev, dtype=dt)
        got = fi_plan.attend(layer, q, k, v, fi_cache)
        want = ref_plan.attend(layer, q, k, v, ref_cache)
        assert got.shape == (t, heads, HEAD_DIM) and got.dtype == dt
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    if cached:
        assert torch.equal(fi_cache.k, ref_cache.k) and torch.equal(fi_cache.v, ref_cache.v)


@pytest.mark.gpu
@pytest.mark.skipif(not available(), reason="FlashInfer backend needs CUDA and flashinfer-python")
def test_flashinfer_interleaved_plans_replan():
    """Two live decode plans on one backend: each attend still sees its own metadata."""
    from inference_eval.engine.attention.flashinfer_backend import FlashInferBackend
    from inference_eval.engine.attention.torch_backend import TorchAttentionBackend

    dev, dt = torch.device("cuda"), torch.bfloat16
    a = BatchLayout([1, 1], [5, 30], [[0], [1, 2]], PAGE)
    b = BatchLayout([1], [40], [[3, 4, 5]], PAGE)
    cache = KVCache(1, 8, PAGE, 2, HEAD_DIM, dt, dev)
    cache.k.normal_()
    cache.v.normal_()
    fib = FlashInferBackend(dev)
    pa, pb = fib.plan(a), fib.plan(b)
    for layout, plan in [(a, pa), (b, pb), (a, pa)]:
        q = torch.randn(layout.num_tokens, 8, HEAD_DIM, device=dev, dtype=dt)
        k = torch.randn(layout.num_tokens, 2, HEAD_DIM, device=dev, dtype=dt)
        v = torch.randn_like(k)
        ref_cache = copy.deepcopy(cache)
        got = plan.attend(0, q, k, v, cache)
        want = TorchAttentionBackend(dev).plan(layout).attend(0, q, k, v, ref_cache)
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_auto_takes_flashinfer_only_for_half_precision(monkeypatch):
    """attention=auto on CUDA: FlashInfer for a bf16/fp16 cache, the torch backend for fp32
    (FlashInfer refuses fp32, so picking it would fail every request of an fp32 target);
    attention=flashinfer with fp32 is refused when the engine is built."""
    from inference_eval.engine.attention import flashinfer_backend as fib
    from inference_eval.engine.attention.plan import make_backend
    from inference_eval.engine.attention.torch_backend import TorchAttentionBackend

    class Stub:
        def __init__(self, dev):
            self.dev = dev

    monkeypatch.setattr(fib, "available", lambda: True)
    monkeypatch.setattr(fib, "FlashInferBackend", Stub)
    assert isinstance(make_backend("auto", "cuda", torch.float32), TorchAttentionBackend)
    assert isinstance(make_backend("auto", "cuda", torch.bfloat16), Stub)
    assert isinstance(make_backend("auto", "cuda", torch.float16), Stub)
    assert isinstance(make_backend("auto", "cuda"), Stub)
    with pytest.raises(ValueError, match="target.dtype=bfloat16 or use attention=torch"):
        make_backend("flashinfer", "cuda", torch.float32)  # asked by name: a clear refusal
    assert isinstance(make_backend("auto", "cpu", torch.bfloat16), TorchAttentionBackend)
