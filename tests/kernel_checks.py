"""One result of each engine CPU kernel against torch's own op, by kernel source name: a
kernel that loads but computes wrong fails where its build is checked (test_native.py and
each kernel's test_kernel_builds), not only in the long per-kernel suites."""
from __future__ import annotations

import torch
import torch.nn.functional as F

TOL = dict(rtol=1e-5, atol=1e-5)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def check_causal():
    """Two packed sequences (3 and 5 rows) vs causal SDPA per sequence."""
    from inference_eval.engine.attention import cpu_causal

    q, k, v = (_randn(8, 2, 64, seed=s) for s in (1, 2, 3))
    got = cpu_causal.causal_attention(q, k, v, torch.tensor([0, 3, 8]), threads=1)
    want = torch.cat([F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in (q, k, v)),
                                                     is_causal=True).transpose(0, 1)
                      for a, b in ((0, 3), (3, 8))])
    torch.testing.assert_close(got, want, **TOL)


def check_paged():
    """One request of 6 keys on pages [2, 0] of 4 slots, its last 2 rows new: the kernel
    appends them and attends (2 query heads on 1 kv head) vs masked SDPA over the same keys."""
    from inference_eval.engine.attention import cpu_paged

    ps, d = 4, 16
    kc, vc = _randn(3 * ps, 1, d, seed=1), _randn(3 * ps, 1, d, seed=2)
    q, k, v = _randn(2, 2, d, seed=3), _randn(2, 1, d, seed=4), _randn(2, 1, d, seed=5)
    slots = torch.tensor([0, 1])  # positions 4, 5: page 0 (the table's second), slots 0, 1
    keys = lambda c: torch.cat([c[2 * ps:3 * ps], c[:2]])  # noqa: E731  (positions 0..5)
    got = cpu_paged.paged_attention(q, k, v, slots, kc, vc, torch.tensor([[2, 0]]),
                                    torch.tensor([0, 2]), torch.tensor([6]), ps)
    seen = torch.arange(6).view(1, -1) < torch.tensor([[5], [6]])  # row i sees keys < 5 + i
    ks, vs = (keys(c).expand(6, 2, d).transpose(0, 1) for c in (kc, vc))
    want = F.scaled_dot_product_attention(q.transpose(0, 1), ks, vs, attn_mask=seen)
    torch.testing.assert_close(got, want.transpose(0, 1), **TOL)


def check_fused():
    """RMSNorm of 3 rows of 64 vs F.rms_norm."""
    from inference_eval.engine.model import cpu_fused

    x, w = _randn(3, 64, seed=1), _randn(64, seed=2)
    (got,) = cpu_fused.kernel().rms_norm(x, w, 1e-5, None, 1)
    torch.testing.assert_close(got, F.rms_norm(x, (64,), w, 1e-5), **TOL)


def check_linear():
    """3 rows x [16, 64] weight (+ bias) vs F.linear."""
    from inference_eval.engine.model import cpu_linear

    x, w, b = _randn(3, 64, seed=1), _randn(16, 64, seed=2), _randn(16, seed=3)
    with torch.inference_mode():
        got = cpu_linear.kernel().small_linear(x, w, b, 1)
    torch.testing.assert_close(got, F.linear(x, w, b), **TOL)


def check_quant():
    """3 rows x a Q4_1-coded [16, 64] weight, from its block code, vs F.linear on the weight."""
    from inference_eval.engine.model import cpu_quant

    w = cpu_quant.gguf_round_trip(0.05 * _randn(16, 64, seed=2), 4)
    p = cpu_quant.pack(w)
    assert p is not None and p.fmt == 4
    x = _randn(3, 64, seed=1)
    with torch.inference_mode():
        got = cpu_quant.kernel().quant_linear(x, p.codes, p.scales, p.fmt, None, 1)
    torch.testing.assert_close(got, F.linear(x, w), **TOL)


CHECKS = {"cpu_causal.cpp": check_causal, "cpu_paged.cpp": check_paged,
          "cpu_fused.cpp": check_fused, "cpu_linear.cpp": check_linear,
          "cpu_quant.cpp": check_quant}
