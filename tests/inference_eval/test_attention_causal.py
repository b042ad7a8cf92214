"""The torch backend's fresh-sequence path (inference_eval/engine/attention/torch_backend.py):
a step of whole new sequences attends with one causal SDPA per sequence over its own rows,
on the backend's threads, and must give what a plain per-sequence softmax loop gives, with
the cache written exactly as the general path writes it."""
from __future__ import annotations

import math

import pytest
import torch

from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention.torch_backend import LONG_ROWS, TorchAttentionPlan
from inference_eval.engine.kv_cache import KVCache

HEADS, KVH, D, PS = 4, 2, 8, 4


def causal_reference(q, k, v, lens):
    """Per packed sequence, per head: softmax(q k^T / sqrt(d) + causal) v in float64; q
    [T, heads, d], k / v [T, kv_heads, d] (grouped heads repeated)."""
    out, start, rep = [], 0, q.shape[1] // k.shape[1]
    for n in lens:
        qs, ks, vs = (x[start:start + n].double() for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(q.shape[-1])
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs))
        start += n
    return torch.cat(out)


def qkv(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return (torch.randn(t, HEADS, D, generator=g), torch.randn(t, KVH, D, generator=g),
            torch.randn(t, KVH, D, generator=g))


@pytest.mark.parametrize("lens", [[7], [5, 1, 9, 3], [LONG_ROWS + 3, 2]])
def test_packed_causal_matches_reference(lens):
    q, k, v = qkv(lens)
    plan = TorchAttentionPlan(BatchLayout.packed(lens), "cpu", threads=2)
    assert plan.causal_spans is not None and plan.mask is None
    before = torch.get_num_threads()
    out = plan.attend(0, q, k, v, None)
    assert torch.get_num_threads() == before  # the long span's thread switch is undone
    torch.testing.assert_close(out, causal_reference(q, k, v, lens).float(), rtol=1e-5, atol=1e-5)


def test_cached_fresh_prefill_matches_reference_and_writes_the_cache():
    """Two fresh prompts on scattered pages: same output as the reference, and the cache
    holds exactly what the general (gather + mask) path writes for the same tokens."""
    lens, tables = [6, 9], [[5, 0], [3, 7, 1]]
    q, k, v = qkv(lens, seed=1)
    fresh = TorchAttentionPlan(BatchLayout(lens, lens, tables, PS), "cpu")
    assert fresh.causal_spans is not None
    c_fresh = KVCache(1, 8, PS, KVH, D)
    out = fresh.attend(0, q, k, v, c_fresh)
    torch.testing.assert_close(out, causal_reference(q, k, v, lens).float(), rtol=1e-5, atol=1e-5)
    # The general path, reached by handing the same layout a (fully visible) tree mask.
    masks = [torch.ones(n, n, dtype=torch.bool).tril() for n in lens]
    general = TorchAttentionPlan(BatchLayout(lens, lens, tables, PS, tree_masks=masks), "cpu")
    assert general.causal_spans is None
    c_general = KVCache(1, 8, PS, KVH, D)
    torch.testing.assert_close(general.attend(0, q, k, v, c_general), out, rtol=1e-5, atol=1e-5)
    for a, b in zip(c_fresh.layer(0), c_general.layer(0)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_steps_with_context_keep_the_general_path():
    """Decode, verification and chunked prefill (q_len < kv_len) are not fresh."""
    for q_lens, kv_lens in (([1, 1], [4, 9]), ([3], [10]), ([4, 2], [4, 7])):
        plan = TorchAttentionPlan(BatchLayout(q_lens, kv_lens, [[0, 1, 2], [3, 4, 5]][:len(q_lens)],
                                              PS), "cpu")
        assert plan.causal_spans is None
