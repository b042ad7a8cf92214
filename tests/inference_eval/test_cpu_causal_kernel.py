"""The CPU causal kernel (inference_eval/engine/attention/cpu_causal.{py,cpp}): steps of whole
fresh sequences (precompute's packed batches, prompt prefills) must attend exactly as a
float64 per-sequence causal softmax does, and as the SDPA path it replaces does, across the
kernel's block edges (32 query rows, 64 keys, 6-row tiles) and grouped-query shapes."""
from __future__ import annotations

import pytest
import torch

from inference_eval.engine.attention import BatchLayout, cpu_causal
from inference_eval.engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionPlan
from inference_eval.engine.kv_cache import KVCache

from kernel_checks import check_causal
from test_attention_causal import causal_reference as reference


def test_kernel_builds():
    # The backend falls back to SDPA without it; where torch's toolchain works (inductor
    # needs it too) that fallback must not hide a broken build.
    assert cpu_causal.kernel() is not None
    check_causal()  # and computes: one result against SDPA
    assert TorchAttentionBackend("cpu").causal_kernel
    assert not TorchAttentionBackend("meta").causal_kernel


def rows(lens, heads, kvh, d, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    return tuple(torch.randn(t, n, d, generator=g) * s
                 for n, s in ((heads, scale), (kvh, scale), (kvh, 1.0)))


def cu(lens):
    return torch.tensor([0] + lens).cumsum(0)


D = 64  # SmolLM2's head_dim; a multiple of the kernel's on AVX2 (16) and AVX-512 (64)
CASES = [  # sequence lengths, query heads, kv heads, head dim
    ([1, 5, 31, 32, 33, 63, 64, 65, 200], 9, 3, D),  # SmolLM2's heads; every block edge
    ([300, 129], 4, 4, 2 * D),     # no grouping, two output chunks per row
    ([77, 64, 1], 8, 2, D),        # 4 query heads per kv head: 128-row blocks
    ([96], 16, 1, D),              # multi-query (MLA's absorbed form is one kv head)
]


@pytest.mark.parametrize("lens,heads,kvh,d", CASES)
def test_kernel_matches_float64_reference(lens, heads, kvh, d):
    q, k, v = rows(lens, heads, kvh, d)
    got = cpu_causal.causal_attention(q, k, v, cu(lens), threads=2)
    torch.testing.assert_close(got.double(), reference(q, k, v, lens), atol=2e-6, rtol=1e-5)


def test_large_scores_stay_stable():
    # Scores with a spread of hundreds (q, k x 8): the online softmax must rescale, not
    # overflow; fp32 scores that large carry ~1e-4 of rounding, so the bar is SDPA's own
    # fp32 error against the same float64 reference.
    lens = [150, 70]
    q, k, v = rows(lens, 9, 3, D, seed=3, scale=8.0)
    want = reference(q, k, v, lens)
    got = cpu_causal.causal_attention(q, k, v, cu(lens), threads=2)
    sdpa = TorchAttentionPlan(BatchLayout.packed(lens), "cpu").attend(0, q, k, v, None)
    assert torch.isfinite(got).all()
    err, sdpa_err = ((x.double() - want).abs().max().item() for x in (got, sdpa))
    assert err <= 2 * sdpa_err + 1e-6, (err, sdpa_err)


def test_threads_change_no_bit():
    lens = [200, 33, 64]
    q, k, v = rows(lens, 9, 3, D, seed=5)
    outs = [cpu_causal.causal_attention(q, k, v, cu(lens), threads=t) for t in (1, 2, 3)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_applies_only_where_the_kernel_is_right():
    q, k, _ = rows([8], 4, 2, D)
    assert cpu_causal.applies(q, k)
    assert not cpu_causal.applies(q.double(), k.double())
    odd = cpu_causal.kernel().head_dim_multiple // 2
    assert not cpu_causal.applies(q[..., :odd], k[..., :odd])
    # No backward in the kernel: a graph that needs gradients takes SDPA.
    assert not cpu_causal.applies(q.requires_grad_(), k)
    with torch.no_grad():
        assert cpu_causal.applies(q, k)


def test_bad_cu_seqlens_named():
    q, k, v = rows([10], 4, 2, D)
    with pytest.raises(RuntimeError, match="cu_seqlens"):
        cpu_causal.causal_attention(q, k, v, torch.tensor([0, 9]))


@pytest.mark.parametrize("cached", [False, True])
def test_plan_uses_the_kernel_and_matches_sdpa(cached):
    # A fresh step through the backend's plan: cacheless (precompute) and cached (prompt
    # prefill, keys appended to the pages too) give SDPA's answer, one kernel call for all.
    lens, heads, kvh = [40, 97, 3], 9, 3
    ps = 16
    tables = None
    if cached:
        pages = [-(-n // ps) for n in lens]
        starts = torch.tensor([0] + pages).cumsum(0).tolist()
        tables = [list(range(s, s + p)) for s, p in zip(starts, pages)]
    layout = BatchLayout(lens, lens, tables, ps)
    q, k, v = rows(lens, heads, kvh, D, seed=7)
    caches = [KVCache(1, 16, ps, kvh, D) if cached else None for _ in range(2)]
    plan = TorchAttentionPlan(layout, "cpu", causal_kernel=True, threads=2)
    assert plan.cu_seqlens is not None
    got = plan.attend(0, q, k, v, caches[0])
    want = TorchAttentionPlan(layout, "cpu").attend(0, q, k, v, caches[1])
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    if cached:
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
