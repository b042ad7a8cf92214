"""Acceptance metrics from generation outputs (pure functions, no I/O).

Inputs are `TurnOutput`s: one per (prompt, turn), carrying the engine's per-step meta
(`proposed[s]`, `accepted[s]` for every target step s). Names and definitions are the ones
docs/evaluation.md gives:

- mean_accept_len τ = tokens emitted per verification round, bonus token included (AR:
  exactly 1): (generated tokens - prefill steps) / (target steps - prefill steps), since a
  prefill step (the prompt, or its recompute after a preemption) emits one token and
  verifies nothing. tokens_per_target_pass = generated tokens / target steps, prefills
  included, is reported beside it (what a short answer actually gets per target forward).
- accept_len_hist[a] = number of target steps that accepted exactly a drafts, a = 0..K.
- per_position_accept_rate α_k = P(draft k accepted | drafts 1..k-1 accepted), k = 1..K.
  Position k is *attempted* in a step when proposed >= k and accepted >= k-1, and
  *accepted* when accepted >= k (acceptance is a prefix, so accepted >= k implies the rest).
  The engine's proposed[s] is what the step judged: a chain's drafts; a tree's depths on the
  verified path (a depth the pruned tree never reached there is not attempted); and when an
  EOS among the drafts ends the request, only the drafts up to it (in accepted[s] too).

Worked example, one request, K = 3, three rounds with (proposed, accepted) = (3,2), (3,0), (3,3)
after its prefill (0,0):
    tokens = 1 + 3 + 1 + 4 = 9, steps = 4, τ = 8/3, tokens per pass 9/4; hist = [2, 0, 1, 1]
    α_1 = 2/3 (steps 1,3 of 3), α_2 = 2/2, α_3 = 1/2
Outputs with an `error` are left out of every number (they are listed in the report instead).

How sure a τ is: `tau_interval` and `tau_difference` resample the prompts (a prompt's turns
and rounds stay together, as its tokens depend on each other) and recompute τ as the same
ratio of sums; their percentile intervals say whether two heads evaluated on the same prompts
differ by more than the prompts' spread. The difference is paired (each replicate draws the
same prompts for both runs), which is what separates heads whose τ differ by a few
hundredths on a few dozen prompts.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


@dataclass
class TurnOutput:
    """One generation: turn `turn` (0-based) of prompt `prompt_id`.

    token_ids: generated ids (prompt excluded). proposed/accepted: [target_steps] ints.
    wall_s is not per output (requests run batched); timing lives on the run."""

    prompt_id: str
    category: str
    turn: int
    token_ids: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    text: str | None = None
    prefill_steps: int = 0  # how many of the steps were prefills (see the module docstring)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def target_steps(self) -> int:
        return len(self.accepted)

    @classmethod
    def from_result(cls, prompt_id: str, category: str, turn: int, result: Any) -> "TurnOutput":
        """From an engine GenerationResult. A meta that breaks the engine contract (lengths
        disagree, accepted > proposed) becomes this output's error, not a crash: one bad
        request must not cost a long run's other results."""
        meta = result.meta or {}
        proposed = [int(x) for x in meta.get("proposed", [])]
        accepted = [int(x) for x in meta.get("accepted", [])]
        prefills = int(meta.get("prefill_steps", 0))
        error = result.error
        if error is None:
            steps = int(meta.get("target_steps", -1))
            if not (steps == len(proposed) == len(accepted)):
                error = (f"engine meta inconsistent: target_steps={steps}, "
                         f"len(proposed)={len(proposed)}, len(accepted)={len(accepted)}")
            elif not 0 <= prefills <= steps:
                error = f"engine meta inconsistent: {prefills} prefill steps of {steps}"
            elif any(a > p or a < 0 for p, a in zip(proposed, accepted)):
                error = "engine meta inconsistent: a step accepted more drafts than it proposed"
            elif len(result.token_ids) > steps + sum(accepted):
                error = (f"engine meta inconsistent: {len(result.token_ids)} tokens from "
                         f"{steps} steps accepting {sum(accepted)} drafts")
        return cls(prompt_id, category, turn, list(result.token_ids), proposed, accepted,
                   result.finish_reason, error, result.text, prefills)


def _ok(outputs: Sequence[TurnOutput]) -> list[TurnOutput]:
    return [o for o in outputs if o.ok]


def _steps(outputs: Sequence[TurnOutput]) -> tuple[np.ndarray, np.ndarray]:
    """All steps of all ok outputs: proposed [S] int64, accepted [S] int64."""
    ok = _ok(outputs)
    p = np.fromiter((x for o in ok for x in o.proposed), dtype=np.int64)
    a = np.fromiter((x for o in ok for x in o.accepted), dtype=np.int64)
    return p, a


def generated_tokens(outputs: Sequence[TurnOutput]) -> int:
    return sum(len(o.token_ids) for o in _ok(outputs))


def target_steps(outputs: Sequence[TurnOutput]) -> int:
    return sum(o.target_steps for o in _ok(outputs))


def prefill_steps(outputs: Sequence[TurnOutput]) -> int:
    return sum(o.prefill_steps for o in _ok(outputs))


def mean_accept_len(outputs: Sequence[TurnOutput]) -> float | None:
    """τ = tokens emitted per verification round (prefills excluded; None without rounds)."""
    pre = prefill_steps(outputs)
    rounds = target_steps(outputs) - pre
    return (generated_tokens(outputs) - pre) / rounds if rounds else None


def tokens_per_target_pass(outputs: Sequence[TurnOutput]) -> float | None:
    """Generated tokens / target forwards, prefills included (None when no step ran)."""
    steps = target_steps(outputs)
    return generated_tokens(outputs) / steps if steps else None


def max_draft_len(outputs: Sequence[TurnOutput]) -> int:
    """K: the most drafts any step proposed (0 for AR)."""
    p, a = _steps(outputs)
    return int(max(p.max(initial=0), a.max(initial=0)))


def accept_len_hist(outputs: Sequence[TurnOutput], k: int | None = None) -> list[int]:
    """[K+1] counts of steps that accepted 0..K drafts; sums to target_steps(outputs)."""
    _, a = _steps(outputs)
    k = max_draft_len(outputs) if k is None else k
    return np.bincount(a, minlength=k + 1).tolist()


def per_position_accept_rate(outputs: Sequence[TurnOutput],
                             k: int | None = None) -> list[float | None]:
    """[K] α_k for k = 1..K; None where position k was never attempted."""
    p, a = _steps(outputs)
    k = max_draft_len(outputs) if k is None else k
    pos = np.arange(1, k + 1)[:, None]                        # [K, 1]
    attempted = ((p[None] >= pos) & (a[None] >= pos - 1)).sum(1)  # [K]
    took = (a[None] >= pos).sum(1)                              # [K]
    return [float(t / n) if n else None for t, n in zip(took.tolist(), attempted.tolist())]


def position_counts(outputs: Sequence[TurnOutput], k: int | None = None) -> dict[str, list[int]]:
    """{"attempted": [K], "accepted": [K]}: the counts behind α, so runs can be pooled."""
    p, a = _steps(outputs)
    k = max_draft_len(outputs) if k is None else k
    pos = np.arange(1, k + 1)[:, None]
    return {"attempted": ((p[None] >= pos) & (a[None] >= pos - 1)).sum(1).tolist(),
            "accepted": (a[None] >= pos).sum(1).tolist()}


def summarize(outputs: Sequence[TurnOutput], k: int | None = None) -> dict[str, Any]:
    """The acceptance numbers of a set of outputs (one run, or one category of a run)."""
    k = max_draft_len(outputs) if k is None else k
    return {
        "num_prompts": len({o.prompt_id for o in outputs}),
        "num_outputs": len(outputs),
        "num_errors": sum(not o.ok for o in outputs),
        "generated_tokens": generated_tokens(outputs),
        "target_steps": target_steps(outputs),
        # Steps that verified at least one draft: the rest (prefill, no proposal) sit in
        # accept_len_hist[0] as well, so hist[0] - (target_steps - draft_steps) were rejections.
        "draft_steps": int((_steps(outputs)[0] > 0).sum()),
        "prefill_steps": prefill_steps(outputs),
        "mean_accept_len": mean_accept_len(outputs),
        "tokens_per_target_pass": tokens_per_target_pass(outputs),
        "accept_len_hist": accept_len_hist(outputs, k),
        "per_position_accept_rate": per_position_accept_rate(outputs, k),
    }


def by_category(outputs: Sequence[TurnOutput], k: int | None = None) -> dict[str, dict[str, Any]]:
    """category -> summarize(outputs of that category), categories sorted. The same K for
    every category, so their histograms line up."""
    k = max_draft_len(outputs) if k is None else k
    groups: dict[str, list[TurnOutput]] = defaultdict(list)
    for o in outputs:
        groups[o.category].append(o)
    return {c: summarize(groups[c], k) for c in sorted(groups)}


def _prompt_rounds(outputs: Sequence[TurnOutput]) -> dict[str, tuple[int, int]]:
    """prompt_id -> (tokens emitted by its verification rounds, its rounds): τ's numerator
    and denominator summed over the prompt's ok turns."""
    out: dict[str, tuple[int, int]] = {}
    for o in _ok(outputs):
        n, d = out.get(o.prompt_id, (0, 0))
        out[o.prompt_id] = (n + len(o.token_ids) - o.prefill_steps,
                            d + o.target_steps - o.prefill_steps)
    return out


def _resampled_taus(runs: Sequence[Sequence[TurnOutput]], reps: int, seed: int
                    ) -> tuple[list[str], np.ndarray, np.ndarray] | None:
    """τ of each run over the prompts every run has, and over `reps` bootstrap draws of
    them: -> (prompt ids, taus [R], drawn taus [reps, R]); None when they share no prompt."""
    per = [_prompt_rounds(r) for r in runs]
    ids = sorted(set.intersection(*(set(p) for p in per)))
    if not ids:
        return None
    num = np.array([[p[i][0] for i in ids] for p in per], dtype=np.float64)  # [R, N]
    den = np.array([[p[i][1] for i in ids] for p in per], dtype=np.float64)
    draws = np.random.default_rng(seed).integers(0, len(ids), (reps, len(ids)))
    weight = np.stack([np.bincount(d, minlength=len(ids)) for d in draws]).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        taus = (weight @ num.T) / (weight @ den.T)  # [reps, R]
        point = num.sum(1) / den.sum(1)
    return ids, point, taus


def _percentiles(x: np.ndarray, level: float) -> list[float] | None:
    """The central `level` interval of the finite values of x; None when there are none."""
    x = x[np.isfinite(x)]
    if not x.size:
        return None
    q = (1 - level) / 2
    return [float(np.quantile(x, q)), float(np.quantile(x, 1 - q))]


def tau_interval(outputs: Sequence[TurnOutput], level: float = 0.95, reps: int = 2000,
                 seed: int = 0) -> list[float] | None:
    """[lo, hi]: the percentile bootstrap interval of τ over the run's prompts (None without
    rounds). Deterministic for a seed."""
    got = _resampled_taus([outputs], reps, seed)
    return None if got is None else _percentiles(got[2][:, 0], level)


def tau_difference(a: Sequence[TurnOutput], b: Sequence[TurnOutput], level: float = 0.95,
                   reps: int = 2000, seed: int = 0) -> dict[str, Any] | None:
    """τ(a) - τ(b) over the prompts both ran, with its paired bootstrap interval:
    {"diff", "ci": [lo, hi], "prompts"}; None when they share no prompt with rounds."""
    got = _resampled_taus([a, b], reps, seed)
    if got is None:
        return None
    ids, point, taus = got
    ci = _percentiles(taus[:, 0] - taus[:, 1], level)
    if ci is None or not np.isfinite(point).all():
        return None
    return {"diff": float(point[0] - point[1]), "ci": ci, "prompts": len(ids)}


def lossless_check(spec: Sequence[TurnOutput], ar: Sequence[TurnOutput],
                   max_listed: int = 20) -> dict[str, Any]:
    """Greedy speculative output must equal greedy AR output token for token.

    Pairs outputs by (prompt_id, turn); pairs where either side errored are not compared.
    Returns {"compared", "mismatched", "mismatches": [{"id", "turn", "at"}] (the first
    max_listed; "at" = index of the first differing token)}.
    Turn t > 0 is only comparable while turn t-1 matched (its context holds the answer)."""
    ar_by_key = {(o.prompt_id, o.turn): o for o in ar if o.ok}
    compared, bad = 0, []
    for o in spec:
        ref = ar_by_key.get((o.prompt_id, o.turn))
        if ref is None or not o.ok:
            continue
        compared += 1
        if list(o.token_ids) != list(ref.token_ids):
            bad.append({"id": o.prompt_id, "turn": o.turn,
                        "at": first_mismatch(o.token_ids, ref.token_ids)})
    return {"compared": compared, "mismatched": len(bad), "mismatches": bad[:max_listed]}


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (or of the shorter end); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
