"""Sampling as pure batched tensor functions (no engine state, no I/O).

Every function takes logits [B, V] and per-row settings [B], so one call serves a batch
mixing greedy and sampled requests. `processed_probs` is the exact distribution a token is
drawn from; speculative acceptance compares target and draft through this same function.
Greedy ties break to the lowest token id (torch.argmax returns the first maximum).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    """temperature 0 = greedy. top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"sampling.top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class SamplingTensors:
    """Per-row settings: temperature [B] fp32, top_k [B] int64, top_p [B] fp32."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    @classmethod
    def from_params(cls, params: list[SamplingParams], device="cpu") -> "SamplingTensors":
        return cls(
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
        )

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature == 0).all())

    def repeat_interleave(self, counts: torch.Tensor) -> "SamplingTensors":
        """Expand to rows per request (e.g. K+1 verification rows each)."""
        return SamplingTensors(self.temperature.repeat_interleave(counts),
                               self.top_k.repeat_interleave(counts),
                               self.top_p.repeat_interleave(counts))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> tokens [B] int64."""
    return logits.argmax(dim=-1)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask all but the k largest logits per row (k = 0 keeps all). Ties at the k-th value stay."""
    v = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v))
    if bool((k == v).all()):
        return logits
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest prefix of tokens (by descending prob) whose mass reaches top_p;
    renormalize. probs [B, V] -> [B, V]."""
    if bool((top_p >= 1.0).all()):
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly before each token
    keep_sorted = before < top_p.unsqueeze(-1)
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(-1, idx, keep_sorted)
    out = probs * keep
    return out / out.sum(dim=-1, keepdim=True)


def processed_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The distribution each row samples from: temperature, then top-k, then top-p.

    Greedy rows (temperature 0) become one-hot on the argmax, so acceptance rules written
    for distributions cover greedy too. logits [B, V] -> probs [B, V] fp32.
    """
    logits = logits.float()
    greedy_rows = st.temperature == 0
    temp = torch.where(greedy_rows, torch.ones_like(st.temperature), st.temperature)
    scaled = apply_top_k(logits / temp.unsqueeze(-1), st.top_k)
    probs = apply_top_p(torch.softmax(scaled, dim=-1), st.top_p)
    if bool(greedy_rows.any()):
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy_rows.unsqueeze(-1), onehot, probs)
    return probs


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs [B, V] -> tokens [B] int64, by inverse-CDF on one uniform per row."""
    u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device)
    cdf = probs.cumsum(dim=-1)
    # right=True: a zero-probability token (flat CDF step) can never be picked.
    tok = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)
    return tok.clamp(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, st: SamplingTensors,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> tokens [B]; greedy rows take the argmax exactly."""
    if st.all_greedy:
        return greedy(logits)
    tok = sample_from_probs(processed_probs(logits, st), generator)
    return torch.where(st.temperature == 0, greedy(logits), tok)
