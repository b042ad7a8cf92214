"""Rotary position embeddings: Llama-3, linear and YaRN frequency scaling.

cos/sin tables are built once per model up to max_position_embeddings and indexed by the
step's positions, so every layer of a step reads the same [T, rope_dim] slices. Tables use
the rotate-half layout; checkpoints trained with interleaved pairs (DeepSeek) have their
rotary weight rows permuted at load instead (see model/deepseek_weights.py).
"""
from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_positions: int | None = None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] fp32, with `linear`, `llama3` or `yarn` scaling.

    `max_positions` is only read by YaRN configs that leave `factor` unset (transformers then
    takes max_position_embeddings / original_max_position_embeddings)."""
    # fp32 like transformers, so positions far into the context rotate identically.
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "yarn":
        return _yarn_inv_freq(inv, head_dim, theta, scaling, max_positions)
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_ctx / low, old_ctx / high
        # Long wavelengths are divided by factor, short ones kept, the band between blended.
        smooth = (old_ctx / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        return torch.where(mid, blended, out)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (use linear, llama3 or yarn)")


def yarn_factor(scaling: dict[str, Any], max_positions: int | None = None) -> float:
    factor = scaling.get("factor")
    if factor is not None:
        return float(factor)
    orig = scaling.get("original_max_position_embeddings")
    if orig is None or max_positions is None:
        raise ValueError("rope_scaling yarn needs `factor` (or original_max_position_embeddings "
                         "and max_position_embeddings to derive it)")
    return max_positions / float(orig)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(scale) + 1 (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(inv: torch.Tensor, dim: int, theta: float, scaling: dict[str, Any],
                   max_positions: int | None) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dimensions that rotate fewer than beta_slow times over the
    original context are interpolated (divided by factor), those rotating more than beta_fast
    times are kept, with a linear ramp between."""
    factor = yarn_factor(scaling, max_positions)
    if "original_max_position_embeddings" not in scaling:
        raise ValueError("rope_scaling yarn needs original_max_position_embeddings")
    orig = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 = extrapolate (original frequency), 0 = interpolate
    return (inv / factor) * (1 - keep) + inv * keep


def rope_attention_factor(scaling: dict[str, Any] | None, max_positions: int | None = None) -> float:
    """The factor transformers multiplies cos/sin by (YaRN only; 1.0 otherwise)."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = yarn_factor(scaling, max_positions)
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all))
    return yarn_mscale(factor)


def rope_tables(inv_freq: torch.Tensor, max_positions: int,
                attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_positions, head_dim] fp32 in the rotate-half layout HF uses."""
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    if attention_factor == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * attention_factor, emb.sin() * attention_factor


def arch_rope_tables(arch) -> tuple[torch.Tensor, torch.Tensor]:
    """A ModelArch's tables: [max_position_embeddings, arch.rope_dim] each."""
    inv = rope_inv_freq(arch.rope_dim, arch.rope_theta, arch.rope_scaling,
                        arch.max_position_embeddings)
    return rope_tables(inv, arch.max_position_embeddings,
                       rope_attention_factor(arch.rope_scaling, arch.max_position_embeddings))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; cos/sin [T, d] -> rotated x, same dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    c, s = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    return x * c + rotated * s
