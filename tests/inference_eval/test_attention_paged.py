"""The CPU paged kernel (inference_eval/engine/attention/cpu_paged.{py,cpp}): decode-like steps
(every request has a few new rows, causal, over scattered pages) must attend exactly as a
float64 per-request softmax loop does, and as the general gather + SDPA path does, for
grouped-query shapes the AVX2 code handles in chunks and the scalar fallback handles."""
from __future__ import annotations

import math

import pytest
import torch

from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention import cpu_paged
from inference_eval.engine.attention.mla_torch import torch_attend_latent
from inference_eval.engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionPlan
from inference_eval.engine.kv_cache import KVCache
from inference_eval.engine.speculative.tree import tree_attention_mask
from kernel_checks import check_paged

PS, PAGES = 4, 64


def test_kernel_builds():
    # The torch backend falls back to SDPA without it; on a machine with torch's compiler
    # toolchain (which inductor needs too) that fallback must not hide a broken build.
    assert cpu_paged.kernel() is not None
    check_paged()  # and computes: one result against SDPA
    assert TorchAttentionBackend("cpu").paged_kernel and not TorchAttentionBackend("meta").paged_kernel


def scattered_layout(q_lens, kv_lens, seed=0):
    """Each request's pages drawn at random from the cache (never consecutive runs)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(PAGES, generator=g).tolist()
    tables, at = [], 0
    for kv in kv_lens:
        n = -(-kv // PS) + 1  # one spare page past kv_len, as a lookahead reservation leaves
        tables.append(perm[at:at + n])
        at += n
    return BatchLayout(q_lens=q_lens, kv_lens=kv_lens, block_tables=tables, page_size=PS)


def filled_cache(heads_kv, d, seed=1, dtype=torch.float32):
    cache = KVCache(1, PAGES, PS, heads_kv, d, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    return cache


def reference(layout, q, cache, heads, kvh, d):
    """Per request, per head, in float64: query row i (of q_len) sees the first
    kv_len - q_len + i + 1 keys of its pages, or, under a tree mask [q_len, m], every key
    before the last m and those of the last m its mask row allows."""
    kc, vc = (x[0].reshape(-1, kvh, d).double() for x in (cache.k, cache.v))
    out, cu = [], layout.cu_q()
    for b, (ql, kv, table) in enumerate(zip(layout.q_lens, layout.kv_lens, layout.block_tables)):
        slots = torch.tensor([table[j // PS] * PS + j % PS for j in range(kv)])
        ks = kc[slots].repeat_interleave(heads // kvh, 1)
        vs = vc[slots].repeat_interleave(heads // kvh, 1)
        qs = q[cu[b]:cu[b + 1]].double()
        s = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(d)
        seen = torch.arange(kv).view(1, -1) < (kv - ql + torch.arange(ql) + 1).view(-1, 1)
        tm = layout.tree_masks[b] if layout.tree_masks is not None else None
        if tm is not None:
            seen = torch.ones(ql, kv, dtype=torch.bool)
            seen[:, kv - tm.shape[1]:] = tm
        s = s.masked_fill(~seen, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs))
    return torch.cat(out)


CASES = [  # q_lens, kv_lens, heads, kv heads, head dim
    ([1] * 5, [3, 17, 9, 30, 1], 9, 3, 64),      # batch decode, SmolLM2's head layout
    ([3, 1, 5], [12, 40, 5], 8, 2, 16),         # chain verification rows beside a decode
    ([1], [37], 4, 1, 8),                       # one request, one row: multi-query attention
    ([2, 2], [20, 7], 16, 2, 8),                # 8 query heads per kv head: two chunks of 4
    ([1, 4], [6, 25], 6, 3, 12),                # head dim not a multiple of 8: scalar code
    ([8] * 2, [8, 31], 4, 4, 16),               # SMALL_Q rows; a request holding only new keys
]


@pytest.mark.parametrize("q_lens,kv_lens,heads,kvh,d", CASES)
def test_paged_kernel_matches_float64_reference_and_general_path(q_lens, kv_lens, heads, kvh, d):
    layout = scattered_layout(q_lens, kv_lens)
    g = torch.Generator().manual_seed(2)
    t = sum(q_lens)
    q, k, v = (torch.randn(t, n, d, generator=g) for n in (heads, kvh, kvh))
    paged, general = filled_cache(kvh, d), filled_cache(kvh, d)
    plan = TorchAttentionPlan(layout, "cpu", paged_kernel=True)
    assert plan.paged is not None and not plan.gathered
    got = plan.attend(0, q, k, v, paged)
    want = TorchAttentionPlan(layout, "cpu").attend(0, q, k, v, general)
    assert torch.equal(paged.k, general.k) and torch.equal(paged.v, general.v)
    torch.testing.assert_close(got.double(), reference(layout, q, paged, heads, kvh, d),
                               atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


TREE = tree_attention_mask(torch.tensor([-1, 0, 0, 0, 1, 1, 2, 4, 4, 7, 3, 5, 9]),
                           torch.ones(13, dtype=torch.bool))  # 13 nodes, depth 5


def test_tree_masks_through_the_kernel():
    # EAGLE-2 verification (a 13-node tree over the request's last 13 keys), a draft-tree
    # level (4 nodes whose mask also covers 8 earlier scratch keys: m > q_len), and a causal
    # request beside them, all in one step; against float64 and the gathered SDPA path.
    level = torch.zeros(4, 12, dtype=torch.bool)
    level[:, 8:] = torch.eye(4, dtype=torch.bool)
    level[:, [1, 5]] = True
    level[2, 6] = True
    layout = scattered_layout([13, 4, 3], [40, 21, 9])
    layout.tree_masks = [TREE, level, None]
    heads, kvh, d = 9, 3, 64
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(20, n, d, generator=g) for n in (heads, kvh, kvh))
    paged, general = filled_cache(kvh, d), filled_cache(kvh, d)
    plan = TorchAttentionBackend("cpu").plan(layout)
    assert plan.paged is not None and not plan.gathered
    got = plan.attend(0, q, k, v, paged)
    want = TorchAttentionPlan(layout, "cpu").attend(0, q, k, v, general)
    assert torch.equal(paged.k, general.k)
    torch.testing.assert_close(got.double(), reference(layout, q, paged, heads, kvh, d),
                               atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    for threads in (1, 3):  # how tasks split between threads changes no bit
        plan = TorchAttentionPlan(layout, "cpu", paged_kernel=True, threads=threads)
        assert torch.equal(plan.attend(0, q, k, v, filled_cache(kvh, d)), got)
    # The mask is read: the same rows, causal (13 rows: SDPA), attend differently.
    layout.tree_masks = None
    causal = TorchAttentionBackend("cpu").plan(layout).attend(0, q, k, v, filled_cache(kvh, d))
    assert not torch.allclose(causal[:13], got[:13], atol=1e-3)
    torch.testing.assert_close(causal[17:], got[17:], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("q_lens,kv_lens,heads,kvh,d", CASES)
def test_kernel_threads_change_no_bit(q_lens, kv_lens, heads, kvh, d):
    # Engine steps pass their thread count explicitly (torch's own is 1 inside them); how the
    # requests and kv heads are split between threads must not change the result.
    layout = scattered_layout(q_lens, kv_lens)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(sum(q_lens), n, d, generator=g) for n in (heads, kvh, kvh))
    outs = []
    for threads in (1, 2, 3):
        plan = TorchAttentionPlan(layout, "cpu", paged_kernel=True, threads=threads)
        outs.append(plan.attend(0, q, k, v, filled_cache(kvh, d)))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_other_dtypes_take_the_general_path():
    layout = scattered_layout([1, 2], [9, 14])
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, n, 8, generator=g, dtype=torch.float64) for n in (4, 2, 2))
    cache = filled_cache(2, 8, dtype=torch.float64)
    plan = TorchAttentionPlan(layout, "cpu", paged_kernel=True)
    got = plan.attend(0, q, k, v, cache)
    assert plan.gathered and got.dtype == torch.float64
    torch.testing.assert_close(got, reference(layout, q, cache, 4, 2, 8))


def test_latent_attention_through_the_kernel():
    # MLA's absorbed form is multi-query attention whose values are the key rows' first
    # v_dim columns (mla_torch.py): the kernel serves it through the same attend.
    layout = scattered_layout([1, 1, 3], [10, 26, 8])
    g = torch.Generator().manual_seed(4)
    heads, dim, v_dim = 8, 24, 16
    q = torch.randn(5, heads, dim, generator=g)
    lat = torch.randn(5, 1, dim, generator=g)
    a = KVCache(1, PAGES, PS, 1, dim, values=False)
    a.k.copy_(torch.randn(a.k.shape, generator=g))
    b = KVCache(1, PAGES, PS, 1, dim, values=False)
    b.k.copy_(a.k)
    plan = TorchAttentionPlan(layout, "cpu", paged_kernel=True)
    got = torch_attend_latent(plan, 0, q, lat, a, v_dim, 0.3)
    want = torch_attend_latent(TorchAttentionPlan(layout, "cpu"), 0, q, lat, b, v_dim, 0.3)
    assert plan.paged is not None and torch.equal(a.k, b.k)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("layout,uses_kernel", [
    (BatchLayout([1, 1], [5, 9], [[0, 1], [2, 3, 4]], PS), True),               # decode
    (BatchLayout([1], [9], [[4, 2, 7]], PS), True),                              # one row
    (BatchLayout([3], [9], [[4, 2, 7]], PS), True),   # one request's verification rows
    (BatchLayout([2, 1], [5, 9], [[0, 1], [2, 3, 4]], PS,
                 tree_masks=[torch.ones(2, 2, dtype=torch.bool), None]), True),   # tree
    (BatchLayout([13], [20], [[0, 1, 2, 3, 4]], PS, tree_masks=[TREE]), True),    # 13 > SMALL_Q
    (BatchLayout([9], [12], [[0, 1, 2]], PS), False),  # 9 causal rows: a prefill chunk
    (BatchLayout([4, 9], [4, 9], [[0], [1, 2, 3]], PS), False),       # fresh: causal SDPA
    (BatchLayout([1, 9], [5, 12], [[0, 1], [2, 3, 4]], PS), False),   # a prefill chunk
])
def test_which_steps_use_the_kernel(layout, uses_kernel):
    assert (TorchAttentionBackend("cpu").plan(layout).paged is not None) == uses_kernel


def _kernel_step(q, k, v, kc, vc, kv_len, mask=None):
    """One request over the whole cache as consecutive pages: q [T, H, d]; k / v [T, kvh, d]
    land at slots kv_len - T .. kv_len - 1; mask: a tree mask [T, T] over those slots."""
    t = q.shape[0]
    table = torch.arange(kc.shape[0] // PS).view(1, -1)
    masks = None if mask is None else cpu_paged.tree_mask_tensors([mask])
    return cpu_paged.paged_attention(q, k, v, torch.arange(kv_len - t, kv_len), kc, vc, table,
                                     torch.tensor([0, t]), torch.tensor([kv_len]), PS, 2, masks)


def test_a_row_attends_bit_for_bit_as_in_a_one_row_step():
    # Lossless speculation rests on this: a verified row's attention must be the very floats
    # the one-row decode step of that position computes, whichever rows beside it the step
    # carries and, under a tree mask, however its ancestors sit between their siblings.
    heads, kvh, d, ctx = 9, 3, 64, 37
    g = torch.Generator().manual_seed(6)
    kc, vc = (torch.randn(PAGES * PS, kvh, d, generator=g) for _ in range(2))
    q, k, v = (torch.randn(13, n, d, generator=g) for n in (heads, kvh, kvh))
    chain = _kernel_step(q[:5], k[:5], v[:5], kc, vc, ctx + 5)
    for i in range(5):  # the cache holds rows 0..4 now; row i alone sees ctx + i + 1 keys
        one = _kernel_step(q[i:i + 1], k[i:i + 1], v[i:i + 1], kc, vc, ctx + i + 1)
        assert torch.equal(one[0], chain[i])
    tree = _kernel_step(q, k, v, kc, vc, ctx + 13, TREE)
    parents = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7, 3, 5, 9]
    for node in (4, 9, 12):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path = path[::-1]  # root .. node: the keys a chain of these tokens would hold
        kc2, vc2 = kc.clone(), vc.clone()
        kc2[ctx:ctx + len(path)], vc2[ctx:ctx + len(path)] = k[path], v[path]
        n = ctx + len(path)
        one = _kernel_step(q[node:node + 1], k[node:node + 1], v[node:node + 1], kc2, vc2, n)
        assert torch.equal(one[0], tree[node])
