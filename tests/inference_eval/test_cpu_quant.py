"""The block-coded weight path (inference_eval/engine/model/cpu_quant.{py,cpp}): a GGUF-coded
fp32 weight is packed only where its code reproduces every weight, and products from the code
are the very floats cpu_linear's kernel computes from the fp32 weight, for every row count."""
from __future__ import annotations

import pytest
import torch

from inference_eval.engine.model import cpu_linear, cpu_quant
from inference_eval.engine.model.linear import Linear, matmul_wt, set_cpu_blas
from kernel_checks import check_quant


def coded(out: int, inp: int, fmt: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * 0.05
    w[0, :32] = 0.25  # a constant block: d = 0
    return cpu_quant.gguf_round_trip(w, fmt)


def decoded(p: cpu_quant.Packed) -> torch.Tensor:
    """The weights a code stands for, rebuilt in torch (what the kernel decodes in registers)."""
    out = p.codes.shape[0]
    if p.fmt == 4:
        c = p.codes.view(out, -1, 16).long()
        q = torch.cat([c & 15, c >> 4], -1).float()
        s = p.scales.view(out, -1, 2)
        return (s[..., :1] * q + s[..., 1:]).reshape(out, -1)
    q = p.codes.view(torch.int8).view(out, -1, 32).float()
    return (p.scales.view(out, -1, 1) * q).reshape(out, -1)


def test_kernel_builds():
    assert cpu_quant.kernel() is not None
    check_quant()  # and computes: one result against F.linear


@pytest.mark.parametrize("fmt", [4, 8])
def test_pack_finds_the_exact_code(fmt):
    w = coded(64, 96, fmt)
    p = cpu_quant.pack(w)
    assert p is not None and p.fmt == fmt
    assert torch.equal(decoded(p), w)
    assert p.codes.numel() == 64 * 96 // (2 if fmt == 4 else 1)


def test_pack_refuses_weights_without_an_exact_code():
    g = torch.Generator().manual_seed(1)
    assert cpu_quant.pack(torch.randn(16, 64, generator=g)) is None  # plain fp32
    w = coded(16, 64, 4)
    w[3, 5] = torch.nextafter(w[3, 5], torch.tensor(1.0))  # one weight off its code
    assert cpu_quant.pack(w) is None
    assert cpu_quant.pack(coded(16, 64, 4)[:, :48].contiguous()) is None  # in % 32 != 0
    assert cpu_quant.pack(coded(16, 64, 4).double()) is None


@pytest.mark.parametrize("fmt", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 16])
def test_products_equal_the_fp32_kernel_bit_for_bit(fmt, rows):
    # Same floats summed in the same order: mixing the two kernels by row count (and the
    # fp32 kernel past SMALL_ROWS) cannot change a greedy token.
    assert cpu_linear.enable(2)
    w = coded(96, 192, fmt, seed=rows)
    p = cpu_quant.pack(w)
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, 192, generator=g), torch.randn(96, generator=g)
    with torch.inference_mode():
        for b in (None, bias):
            got = cpu_quant.linear(x, p, b)
            assert torch.equal(got, cpu_linear.linear(x, w, b))
            want = x.double() @ w.double().t() + (0 if b is None else b.double())
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_engine_layers_take_the_code_and_keep_their_results():
    lin = Linear(64, 40)
    with torch.no_grad():
        lin.weight.copy_(coded(40, 64, 4))
    x = torch.randn(3, 64)
    with torch.inference_mode():
        set_cpu_blas(lin, True)
        assert lin.packed is not None and lin.packed.fmt == 4
        code = lin.packed
        set_cpu_blas(lin, True)  # a second engine over the same weights keeps the code
        assert lin.packed is code
        got = lin(x)
        assert torch.equal(got, matmul_wt(x, lin.weight, True, lin.bias))  # fp32 kernel
        set_cpu_blas(lin, False)
        assert lin.packed is None
        torch.testing.assert_close(lin(x), got, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        lin.weight.add_(1e-3)  # the weight changed: its old code must not serve
    set_cpu_blas(lin, True)
    assert lin.packed is None


def test_engine_switch_keeps_the_fp32_weights():
    from inference_eval.engine.config import EngineConfig
    from inference_eval.engine.llm_engine import LLMEngine
    from inference_eval.engine.model.arch import ModelArch
    from inference_eval.engine.model.transformer import TransformerLM
    from inference_eval.engine.sampling import SamplingParams

    # Tied, every weight GGUF-coded (layers Q4_1, embedding Q8_0), so the whole model packs.
    arch = ModelArch(vocab_size=64, intermediate_size=96, tie_word_embeddings=True)
    model = TransformerLM(arch).eval().requires_grad_(False)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, Linear):
                m.weight.copy_(coded(*m.weight.shape, fmt=4))
        model.embed_tokens.weight.copy_(coded(64, 64, 8))
    params = dict(max_new_tokens=6)
    outs = []
    for codes in (True, False):
        eng = LLMEngine(model, None, EngineConfig(weight_codes=codes))
        packed = [m.packed for m in model.modules() if hasattr(m, "packed")]
        assert all(p is not None for p in packed) if codes else all(p is None for p in packed)
        outs.append([r.token_ids for r in eng.generate([[1, 5, 9], [3, 4]], SamplingParams(**params),
                                                       progress=False)])
    assert outs[0] == outs[1]
