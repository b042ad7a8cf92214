"""The fused CPU elementwise kernels (inference_eval/engine/model/cpu_fused.{py,cpp}): RMSNorm
(with the residual add), silu(gate) * up and the qkv split with rope must equal torch's
ops; autograd keeps torch's ops. Whole models with the CPU fast path on are checked against
transformers in test_model_parity.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference_eval.engine.model import cpu_fused
from inference_eval.engine.model.norm import RMSNorm
from inference_eval.engine.model.rope import apply_rope
from kernel_checks import check_fused


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_kernel_builds():
    assert cpu_fused.kernel() is not None
    check_fused()  # and computes: one result against F.rms_norm


@pytest.mark.parametrize("rows", [1, 3, 700])  # one thread below the parallel threshold, two above
def test_rms_norm_matches_torch(rows):
    x, w = randn(rows, 576), randn(576, seed=1)
    want = F.rms_norm(x, (576,), w, 1e-5)
    torch.testing.assert_close(cpu_fused.rms_norm(x, w, 1e-5), want, rtol=1e-5, atol=1e-6)
    r = randn(rows, 576, seed=2)
    s, n = cpu_fused.rms_norm(x, w, 1e-5, r)
    assert torch.equal(s, x + r)
    torch.testing.assert_close(n, F.rms_norm(x + r, (576,), w, 1e-5), rtol=1e-5, atol=1e-6)


def test_rms_norm_of_strided_heads():
    # q_norm-style input: [T, heads, d] views of a wider row.
    wide = randn(5, 3 * 64)
    x = wide[:, :128].view(5, 2, 64)
    w = randn(64, seed=1)
    torch.testing.assert_close(cpu_fused.rms_norm(x, w, 1e-6), F.rms_norm(x, (64,), w, 1e-6),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [2, 300])
def test_silu_mul_matches_torch(rows):
    gu = randn(rows, 2 * 1536) * 6  # well into both tails of the sigmoid
    gu[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -30.0])
    gate, up = gu.split([1536, 1536], dim=-1)
    assert cpu_fused.silu_mul_applies(gu)
    torch.testing.assert_close(cpu_fused.silu_mul(gu), F.silu(gate) * up, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 200])
def test_rope_split_matches_apply_rope(rows):
    heads, kvh, d = 9, 3, 64
    qkv = randn(rows, (heads + 2 * kvh) * d + 8)[:, 8:]  # strided rows, as a view would be
    pos = torch.arange(rows) * 7
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.outer(pos.float(), inv)] * 2, dim=-1)
    cos, sin = emb.cos(), emb.sin()
    q, k, v = cpu_fused.rope_split(qkv, cos, sin, heads, kvh, d)
    wq, wk, wv = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    torch.testing.assert_close(q, apply_rope(wq.reshape(rows, heads, d), cos, sin), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, apply_rope(wk.reshape(rows, kvh, d), cos, sin), rtol=1e-5, atol=1e-6)
    assert torch.equal(v, wv.reshape(rows, kvh, d))


@pytest.mark.parametrize("rows", [1, 4, 200])
def test_rope_split_with_qk_norms_matches_the_layer_ops(rows):
    """A q/k-normed layer (Qwen3, DFlash): each head's row RMS-normed with its weight, then
    rotated, as RMSNorm + apply_rope do; the norm changes the result, so it is applied."""
    heads, kvh, d, eps = 9, 3, 64, 1e-6
    qkv = randn(rows, (heads + 2 * kvh) * d + 8)[:, 8:] * 3
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.outer(torch.arange(rows).float() * 5, inv)] * 2, dim=-1)
    cos, sin = emb.cos(), emb.sin()
    qn, kn = RMSNorm(d, eps), RMSNorm(d, eps)
    with torch.no_grad():
        qn.weight.copy_(randn(d)), kn.weight.copy_(randn(d))
    q, k, v = cpu_fused.rope_split(qkv, cos, sin, heads, kvh, d, qn.weight.detach(),
                                   kn.weight.detach(), eps)
    wq, wk, wv = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
    with torch.no_grad():
        want_q = apply_rope(qn(wq.reshape(rows, heads, d)), cos, sin)
        want_k = apply_rope(kn(wk.reshape(rows, kvh, d)), cos, sin)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(q, apply_rope(wq.reshape(rows, heads, d), cos, sin), atol=1e-3)
    assert torch.equal(v, wv.reshape(rows, kvh, d))


def test_autograd_keeps_torch_ops():
    norm = RMSNorm(64, 1e-6)
    norm.cpu_blas = True
    x = randn(4, 64).requires_grad_()
    assert not cpu_fused.applies(x)
    norm(x).sum().backward()  # torch's ops: the kernel has no backward
    assert x.grad is not None and norm.weight.grad is not None
