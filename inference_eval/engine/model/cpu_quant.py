"""fp32 products that stream a weight as the 4- or 8-bit block code it came from (cpu_quant.cpp).

The embedded target is a GGUF file in Q4_1 (Q8_0 for the tied embedding / lm_head): every
block of 32 weights of a row holds w = d * q + m (q in 0..15) or w = d * q (q in -127..127),
d and m fp16. Loading dequantizes it to fp32 (540 MB a step at batch 1), which is what the
engine computes with; a decode step streams all of it, so its products are a memory stream.
`pack` finds that code again in the fp32 weights and keeps it beside them only where it
reproduces every weight bit for bit (0.75 byte a weight for Q4_1, 1.125 for Q8_0 instead of
4). The kernel decodes each weight vector in registers with one fused multiply-add whose
product is exact, so the model computes with the same fp32 weights, from a 4-5x shorter
stream. A weight with no exact code (a bf16 or fp32 checkpoint, another quantization) keeps
cpu_linear's path.

Measured on a whole SmolLM2 step's products (figures: docs/benchmarks.md, bench_gemm.py), the
shorter stream makes a batch-1 step about 2.5x faster than the fp32 kernel's, and the gain
shrinks with the rows until both are compute-bound at ~16. Up to 6 rows (AVX-512; 1 with
AVX2) each weight vector is decoded in registers once
for all rows (4-6 rows as two tiles of 4 outputs); more rows decode a block of 8 weight rows
once into an L1/L2 scratch that the fp32 tiles then read, so from ~16 rows on the products
are compute-bound either way. `code_weights` rounds a draft head's trained weights to a code
(engine.head_code) so that its products take this path too. The kernel
walks the weights in cpu_linear's order with its tiles and reduction: its results are the
fp32 kernel's bit for bit (tested), so the engine may pick either by row count without
changing a token. linear.matmul_wt takes it for CPU fp32 inference products of up to
cpu_linear.SMALL_ROWS rows (decode, verification, draft steps, small batches), eager steps
and compiled ones alike (the op `specheads::quant_linear`); linear.set_cpu_blas packs every
Linear, the tied lm_head and a draft head's rows of it once per weight (~4 s for SmolLM2).
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import torch

from inference_eval.engine import native
from inference_eval.engine.model import cpu_linear

BLOCK = 32


class Packed(NamedTuple):
    """A weight [out, in] as its exact block code: codes uint8 [out, in / 32 * bytes], scales
    fp32 [out, in / 32 * (2 for Q4_1: d, m; 1 for Q8_0: d)], fmt 4 or 8."""

    codes: torch.Tensor
    scales: torch.Tensor
    fmt: int


@functools.cache
def kernel():
    """The compiled module (its `quant_linear`), or None where it cannot be built."""
    mod = native.build(Path(__file__).with_suffix(".cpp"),
                       "block-coded weights are read as fp32 instead")
    if mod is not None:
        torch.library.register_fake("specheads::quant_linear")(
            lambda x, codes, scales, fmt, bias, threads: x.new_empty((x.shape[0], codes.shape[0])))
    return mod


def _fp16_near(x: torch.Tensor) -> list[torch.Tensor]:
    """fp16 values (as fp32) nearest to x >= 0, and one step either side."""
    h = x.half()
    bits = h.view(torch.int16)
    up = (bits + 1).view(torch.float16)
    down = torch.where(bits > 0, bits - 1, bits).view(torch.float16)
    return [h.float(), up.float(), down.float()]


def _q4_1(b: torch.Tensor) -> Packed | None:
    """b [out, nb, 32] -> its Q4_1 code, or None. The block's least weight is m (q = 0) and
    its largest d * 15 + m, as GGUF's quantizer writes them; d is tried at the nearest fp16
    of (max - min) / 15 and one step either side, block by block."""
    m = b.amin(-1, keepdim=True)
    if not torch.equal(m.half().float(), m):
        return None
    span = b.amax(-1, keepdim=True) - m
    found = torch.zeros(m.shape, dtype=torch.bool)
    d_best, q_best = torch.zeros_like(m), torch.zeros(b.shape, dtype=torch.uint8)
    for d in _fp16_near(span / 15):
        q = torch.where(d > 0, ((b - m) / torch.where(d > 0, d, 1.0)).round(), 0.0).clamp(0, 15)
        ok = ((d * q + m) == b).all(-1, keepdim=True) & ~found
        d_best = torch.where(ok, d, d_best)
        q_best = torch.where(ok, q.to(torch.uint8), q_best)
        found |= ok
    if not bool(found.all()):
        return None
    codes = q_best[..., :16] | (q_best[..., 16:] << 4)  # byte j: weight j, weight j + 16
    out = b.shape[0]
    return Packed(codes.reshape(out, -1).contiguous(),
                  torch.cat([d_best, m], -1).reshape(out, -1).contiguous(), 4)


def _q8_0(b: torch.Tensor) -> Packed | None:
    """b [out, nb, 32] -> its Q8_0 code, or None: d = max |w| / 127 (the largest weight has
    q = +-127), which must be an fp16 value."""
    d = b.abs().amax(-1, keepdim=True) / 127
    if not torch.equal(d.half().float(), d):
        return None
    q = torch.where(d > 0, b / torch.where(d > 0, d, 1.0), 0.0).round()
    if not bool(((q.abs() <= 127) & (d * q == b)).all()):
        return None
    out = b.shape[0]
    return Packed(q.to(torch.int8).view(torch.uint8).reshape(out, -1).contiguous(),
                  d.reshape(out, -1).contiguous(), 8)


def codable(weight: torch.Tensor) -> bool:
    """Whether the kernel can take `weight` as a block code: [out, in] fp32 on CPU, in a
    multiple of 32 (whole blocks), out of 8 (whole tiles)."""
    return (weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.shape[1] % BLOCK == 0 and weight.shape[0] % 8 == 0)


def pack(weight: torch.Tensor) -> Packed | None:
    """weight [out, in] fp32 on CPU -> its exact Q4_1 or Q8_0 code (the smaller that
    reproduces every weight), or None."""
    if not codable(weight):
        return None
    with torch.no_grad():
        b = weight.detach().reshape(weight.shape[0], -1, BLOCK)
        return _q4_1(b) or _q8_0(b)


def applies(x: torch.Tensor, packed: Packed | None) -> bool:
    """Whether x [M, in] @ weight.T can run from `packed`: a code, CPU fp32 inference (the
    caller picks the row counts: linear.matmul_wt)."""
    return (packed is not None and x.dim() == 2 and x.dtype == torch.float32
            and x.device.type == "cpu" and not torch.is_grad_enabled())


def linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] @ weight[out, in].T + bias [out] -> [M, out]; call only where applies()."""
    threads = cpu_linear.threads()
    if torch.compiler.is_compiling():
        return torch.ops.specheads.quant_linear(x.contiguous(), packed.codes, packed.scales,
                                                packed.fmt, bias, threads)
    return kernel().quant_linear(x.contiguous(), packed.codes, packed.scales, packed.fmt, bias,
                                 threads)


CODE_FORMATS = {"q8_0": 8, "q4_1": 4}  # engine.head_code -> quant_linear fmt


def code_weights(model: torch.nn.Module, code: str) -> int:
    """Round, in place, every trained weight (an nn.Parameter) of `model` that its fast path
    may pack (modules with a `packed` slot: Linear layers, EAGLE-3's own lm_head rows) to GGUF
    block code `code` (q8_0, q4_1), so that `pack` finds it and its small-row products read
    1.125 (0.75) bytes a weight instead of 4. Unlike the target's codes this changes the
    floats: for draft heads, whose drafts verification checks anyway (engine.head_code).
    Buffers are never touched (a head's frozen lm_head rows share or copy the target's);
    shapes the kernel cannot take stay fp32. Returns how many weights were rounded."""
    fmt = CODE_FORMATS[code]
    done = 0
    with torch.no_grad():
        for m in model.modules():
            if not hasattr(m, "packed"):
                continue
            w = m.packable_weight()
            if isinstance(w, torch.nn.Parameter) and codable(w):
                w.copy_(gguf_round_trip(w, fmt))
                done += 1
    return done


def gguf_round_trip(weight: torch.Tensor, fmt: int) -> torch.Tensor:
    """weight [out, in] -> the fp32 weights GGUF's reference quantizer (Q4_1: fmt 4, Q8_0:
    fmt 8) and its dequantizer make of it: what a GGUF target loads, for tests and
    benchmarks of the packed path."""
    b = weight.detach().float().reshape(weight.shape[0], -1, BLOCK)
    if fmt == 4:
        lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        q = ((b - lo) * torch.where(d > 0, 1 / d, 0.0) + 0.5).trunc().clamp(max=15)
        out = d.half().float() * q + lo.half().float()
    elif fmt == 8:
        d = b.abs().amax(-1, keepdim=True) / 127
        out = d.half().float() * (b * torch.where(d > 0, 1 / d, 0.0)).round()
    else:
        raise ValueError(f"fmt {fmt}: 4 (Q4_1) or 8 (Q8_0)")
    return out.reshape(weight.shape).contiguous()
