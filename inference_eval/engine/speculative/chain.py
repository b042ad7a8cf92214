"""Verification of a chain of K draft tokens per request, greedy and sampled.

Index table (per request b, n = num_draft[b] <= K):

| row i of target_logits/probs | conditioned on                  | judges            |
|------------------------------|---------------------------------|-------------------|
| 0                            | context                         | draft_tokens[0]   |
| i (1 <= i < n)               | context + draft_tokens[:i]      | draft_tokens[i]   |
| n                            | context + draft_tokens[:n]      | bonus token       |
| > n                          | unused (padding)                |                   |

Both verifiers return `accepted` [B] (draft tokens accepted, 0..num_draft) and `out_tokens`
[B, K+1] int64: the accepted drafts, then one token drawn by the target (the correction on a
rejection, the bonus when every draft was accepted), then -1. A request therefore always emits
accepted + 1 tokens, which is what τ counts.
"""
from __future__ import annotations

import torch

from inference_eval.engine.sampling import sample_from_probs


def _check(draft_tokens: torch.Tensor, target: torch.Tensor, num_draft: torch.Tensor) -> None:
    b, k = draft_tokens.shape
    if target.shape[:2] != (b, k + 1):
        raise ValueError(f"target must be [B, K+1, V] = [{b}, {k + 1}, V], "
                         f"got {tuple(target.shape)}")
    if num_draft.shape != (b,):
        raise ValueError(f"num_draft must be [B] = [{b}], got {tuple(num_draft.shape)}")
    # Checked where the values live: on a GPU an `if` on them would stall the round on a
    # device-to-host read; this raises there at the next sync, on a CPU at once.
    torch._assert_async(((num_draft >= 0) & (num_draft <= k)).all(),
                        f"num_draft must satisfy 0 <= num_draft <= K={k}")


def _out_tokens(draft_tokens: torch.Tensor, accepted: torch.Tensor,
                last: torch.Tensor) -> torch.Tensor:
    """draft [B, K], accepted [B], last [B] -> out_tokens [B, K+1]: drafts[:accepted], last, -1."""
    b, k = draft_tokens.shape
    pos = torch.arange(k + 1, device=draft_tokens.device).unsqueeze(0)
    padded = torch.cat([draft_tokens, draft_tokens.new_full((b, 1), -1)], dim=1)
    out = torch.where(pos < accepted.unsqueeze(1), padded, torch.full_like(padded, -1))
    return out.scatter(1, accepted.unsqueeze(1), last.unsqueeze(1))


def _leading_true(ok: torch.Tensor) -> torch.Tensor:
    """ok [B, K] bool -> [B] int64: length of the all-True prefix of each row."""
    return ok.long().cumprod(dim=1).sum(dim=1)


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor,
                  num_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest draft prefix that equals the target's argmax.

    draft_tokens [B, K] int64, target_logits [B, K+1, V], num_draft [B] int64 ->
    (accepted [B] int64, out_tokens [B, K+1] int64 padded with -1).
    The correction/bonus token is the target argmax at row `accepted`; ties break to the
    lowest id, as in `sampling.greedy`.
    """
    _check(draft_tokens, target_logits, num_draft)
    k = draft_tokens.shape[1]
    target_tok = target_logits.argmax(dim=-1)  # [B, K+1], first maximum = lowest id
    in_range = torch.arange(k, device=draft_tokens.device).unsqueeze(0) < num_draft.unsqueeze(1)
    accepted = _leading_true((draft_tokens == target_tok[:, :k]) & in_range)
    last = target_tok.gather(1, accepted.unsqueeze(1)).squeeze(1)
    return accepted, _out_tokens(draft_tokens, accepted, last)


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim; [..., V] -> [..., V].

    The all-zero residual (p == q) belongs to a rejection that has probability 0; if rounding
    ever produces it we fall back to p, which is as good as any choice for a null event and
    keeps the sampler from dividing by zero.
    """
    r = (p - q).clamp_min(0.0)
    mass = r.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), p)


def accept_mask(u: torch.Tensor, p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """Speculative acceptance test u < min(1, p(x)/q(x)) written as u * q(x) < p(x).

    With u in [0, 1) the product form needs no division: p(x) >= q(x) always accepts, p(x) == 0
    never does (a token the target forbids is never emitted), and q(x) == 0 (a token the draft
    could not have proposed) accepts iff p(x) > 0. All args broadcast; returns bool.
    """
    return u * q_x < p_x


def verify_sampled(draft_tokens: torch.Tensor, draft_probs: torch.Tensor,
                   target_probs: torch.Tensor, num_draft: torch.Tensor,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling for a chain (Leviathan et al. 2023, Chen et al. 2023).

    draft_tokens [B, K] int64, draft_probs [B, K, V] (q_i: the distribution draft token i was
    drawn from), target_probs [B, K+1, V] (p_i), num_draft [B] int64, both fp32 and both ALREADY
    processed by `sampling.processed_probs` with the same settings ->
    (accepted [B] int64, out_tokens [B, K+1] int64 padded with -1).

    Draft i < num_draft is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
    rejection j the emitted token is drawn from norm(max(0, p_j - q_j)); if all n drafts pass,
    the bonus is drawn from p_n. Each emitted token is then distributed exactly as p.

    q must be the distribution the draft token was really drawn from: a draft that picks its
    argmax passes a one-hot q. Greedy is the special case p = one-hot(argmax target), q =
    one-hot(draft): acceptance becomes "x_i == argmax p_i" and the residual is one-hot on the
    argmax, so the result equals `verify_greedy` whatever the generator draws.

    Randomness, in this order: torch.rand(B, K) acceptance uniforms, then one
    `sample_from_probs` call on [B, V] for the final token.
    """
    _check(draft_tokens, target_probs, num_draft)
    if draft_probs.shape[:2] != draft_tokens.shape:
        raise ValueError(f"draft_probs must be [B, K, V], got {tuple(draft_probs.shape)}")
    b, k = draft_tokens.shape
    idx = draft_tokens.unsqueeze(-1)
    p_x = target_probs[:, :k].gather(-1, idx).squeeze(-1)  # [B, K]
    q_x = draft_probs.gather(-1, idx).squeeze(-1)  # [B, K]
    u = torch.rand(b, k, generator=generator, device=draft_tokens.device)
    in_range = torch.arange(k, device=draft_tokens.device).unsqueeze(0) < num_draft.unsqueeze(1)
    accepted = _leading_true(accept_mask(u, p_x, q_x) & in_range)

    rows = torch.arange(b, device=draft_tokens.device)
    p_last = target_probs[rows, accepted]  # [B, V]
    # Rows that stopped on a rejection (accepted < num_draft) sample the residual at that
    # position; rows that accepted everything sample the bonus from p_n untouched.
    if k > 0:
        q_last = draft_probs[rows, accepted.clamp(max=k - 1)]
    else:
        q_last = torch.zeros_like(p_last)
    rejected = (accepted < num_draft).unsqueeze(-1)
    final = torch.where(rejected, residual_probs(p_last, q_last), p_last)
    last = sample_from_probs(final, generator)
    return accepted, _out_tokens(draft_tokens, accepted, last)
