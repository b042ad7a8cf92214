"""Acceptance metrics against hand-worked examples and a per-step Python loop."""
from __future__ import annotations

import random
import re
from types import SimpleNamespace

import pytest

from inference_eval.evaluation.metrics import (
    TurnOutput,
    accept_len_hist,
    by_category,
    lossless_check,
    mean_accept_len,
    tokens_per_target_pass,
    per_position_accept_rate,
    summarize,
)


def _out(steps, pid="p", cat="c", turn=0, tokens=None, error=None, prefills=0):
    """TurnOutput from [(proposed, accepted)] steps, the first `prefills` of them prefills;
    tokens default to accepted + 1 per step."""
    p = [s[0] for s in steps]
    a = [s[1] for s in steps]
    n = sum(x + 1 for x in a) if tokens is None else tokens
    return TurnOutput(pid, cat, turn, list(range(n)), p, a, "length", error, None, prefills)


def test_docstring_example_by_hand():
    # K = 3; a prefill, then rounds (3,2), (3,0), (3,3): tokens 1 + 3 + 1 + 4 = 9 over 4
    # target passes, 8 of them from the 3 verification rounds.
    o = [_out([(0, 0), (3, 2), (3, 0), (3, 3)], prefills=1)]
    assert mean_accept_len(o) == pytest.approx(8 / 3)
    assert tokens_per_target_pass(o) == pytest.approx(9 / 4)
    assert accept_len_hist(o) == [2, 0, 1, 1]
    assert per_position_accept_rate(o) == pytest.approx([2 / 3, 2 / 2, 1 / 2])


def test_prefill_only_output_has_no_tau():
    o = [_out([(0, 0)], prefills=1)]
    assert mean_accept_len(o) is None and tokens_per_target_pass(o) == 1.0


def test_variable_draft_lengths_by_hand():
    # A prefill step (0,0) never attempts position 1; a step proposing 1 cannot attempt 2.
    o = [_out([(0, 0), (2, 2), (1, 1), (2, 1)], prefills=1)]
    assert mean_accept_len(o) == pytest.approx(7 / 3)  # rounds emit 3 + 2 + 2
    assert tokens_per_target_pass(o) == pytest.approx(8 / 4)
    assert accept_len_hist(o) == [1, 2, 1]
    # position 1: attempted in steps 2,3,4 (all accepted); position 2: steps 2 and 4 -> 1 of 2
    assert per_position_accept_rate(o) == pytest.approx([1.0, 0.5])
    assert per_position_accept_rate(o, k=3) == pytest.approx([1.0, 0.5, None])


def test_autoregressive_is_tau_one():
    o = [_out([(0, 0)] * 5, pid="a"), _out([(0, 0)] * 3, pid="b")]
    s = summarize(o)
    assert s["mean_accept_len"] == 1.0 and s["accept_len_hist"] == [8]
    assert s["per_position_accept_rate"] == [] and s["target_steps"] == 8 == s["generated_tokens"]
    assert s["draft_steps"] == 0


def _loop_metrics(outputs, k):
    """The definitions, one step at a time (τ over the rounds after each output's prefills)."""
    hist, att, acc, toks, steps = [0] * (k + 1), [0] * k, [0] * k, 0, 0
    for o in outputs:
        if o.error:
            continue
        toks += len(o.token_ids) - o.prefill_steps
        for j, (p, a) in enumerate(zip(o.proposed, o.accepted)):
            steps += j >= o.prefill_steps
            hist[a] += 1
            for pos in range(1, k + 1):
                if p >= pos and a >= pos - 1:
                    att[pos - 1] += 1
                    acc[pos - 1] += a >= pos
    alpha = [acc[i] / att[i] if att[i] else None for i in range(k)]
    return toks / steps, hist, alpha


@pytest.mark.parametrize("seed", range(5))
def test_vectorized_equals_per_step_loop(seed):
    rng = random.Random(seed)
    outs = []
    for i in range(12):
        steps = [(0, 0)]
        for _ in range(rng.randint(0, 20)):
            p = rng.randint(1, 5)
            steps.append((p, rng.randint(0, p)))
        # max_new_tokens can cut the last step short: fewer tokens than accepted + 1
        o = _out(steps, pid=f"p{i}", cat=rng.choice("xyz"), tokens=None, prefills=1)
        o.token_ids = o.token_ids[:len(o.token_ids) - rng.randint(0, 1) * (len(steps) > 1)]
        o.error = "boom" if i == 3 else None
        outs.append(o)
    k = max(p for o in outs if not o.error for p in o.proposed)
    tau, hist, alpha = _loop_metrics(outs, k)
    assert mean_accept_len(outs) == pytest.approx(tau)
    assert accept_len_hist(outs) == hist
    assert per_position_accept_rate(outs) == pytest.approx(alpha)
    cats = by_category(outs)
    assert sum(c["target_steps"] for c in cats.values()) == sum(hist) == sum(
        len(o.accepted) for o in outs if not o.error)
    for c, s in cats.items():
        sub = [o for o in outs if o.category == c]
        ctau, chist, calpha = _loop_metrics(sub, k)
        assert s["mean_accept_len"] == pytest.approx(ctau)
        assert s["accept_len_hist"] == chist  # same K in every category
        assert s["per_position_accept_rate"] == pytest.approx(calpha)


def test_errored_outputs_are_left_out():
    o = [_out([(2, 2)]), _out([(2, 0)] * 4, pid="bad", error="oom")]
    s = summarize(o)
    assert s["mean_accept_len"] == 3.0 and s["num_errors"] == 1 and s["num_outputs"] == 2
    assert mean_accept_len([o[1]]) is None


def test_lossless_check_pairs_by_prompt_and_turn():
    ar = [_out([(0, 0)] * 3, pid="a"), _out([(0, 0)] * 3, pid="a", turn=1),
          _out([(0, 0)] * 3, pid="b"), _out([(0, 0)] * 3, pid="c", error="x")]
    spec = [_out([(2, 2)], pid="a"), _out([(2, 1)], pid="a", turn=1),  # 2 tokens != 3
            _out([(2, 2)], pid="b"), _out([(2, 2)], pid="c"), _out([(2, 2)], pid="new")]
    spec[2].token_ids = [0, 7, 2]
    res = lossless_check(spec, ar)
    assert res["compared"] == 3 and res["mismatched"] == 2
    assert res["mismatches"] == [{"id": "a", "turn": 1, "at": 2}, {"id": "b", "turn": 0, "at": 1}]
    assert lossless_check(ar, ar) == {"compared": 3, "mismatched": 0, "mismatches": []}


@pytest.mark.parametrize("meta, tokens, msg", [
    ({"target_steps": 3, "proposed": [0, 2], "accepted": [0, 1]}, 3, "len\\(proposed\\)=2"),
    ({"target_steps": 2, "proposed": [0, 1], "accepted": [0, 2]}, 3, "more drafts than"),
    ({"target_steps": 2, "proposed": [0, 2], "accepted": [0, 1]}, 4, "4 tokens from 2 steps"),
    ({}, 1, "target_steps=-1"),
])
def test_engine_meta_contract_violations_become_errors(meta, tokens, msg):
    res = SimpleNamespace(token_ids=list(range(tokens)), meta=meta, error=None,
                          finish_reason="length", text="t")
    out = TurnOutput.from_result("p", "c", 0, res)
    assert not out.ok and out.error.startswith("engine meta inconsistent")
    assert re.search(msg, out.error)


def test_from_result_keeps_engine_errors_and_good_meta():
    bad = SimpleNamespace(token_ids=[], meta={}, error="prompt 0: empty", finish_reason="error",
                          text=None)
    assert TurnOutput.from_result("p", "c", 0, bad).error == "prompt 0: empty"
    good = SimpleNamespace(token_ids=[5, 6, 7], meta={"target_steps": 2, "proposed": [0, 3],
                           "accepted": [0, 1]}, error=None, finish_reason="stop", text="x")
    out = TurnOutput.from_result("p", "c", 1, good)
    assert out.ok and out.target_steps == 2 and out.turn == 1


# ---- how sure a τ is: bootstrap over prompts ---------------------------------------------
def _prompts(accepts: list[list[int]], k: int = 3, tag: str = "p") -> list[TurnOutput]:
    """One output per prompt: a prefill, then rounds proposing k drafts and accepting the
    listed counts."""
    return [_out([(0, 0)] + [(k, a) for a in acc], pid=f"{tag}{i}", prefills=1)
            for i, acc in enumerate(accepts)]


def _loop_taus(runs, reps, seed):
    """τ of each run per replicate by a plain loop over the drawn prompt indices."""
    import numpy as np

    ids = sorted({o.prompt_id for o in runs[0]})
    draws = np.random.default_rng(seed).integers(0, len(ids), (reps, len(ids)))
    out = []
    for d in draws:
        row = []
        for run in runs:
            by_id = {o.prompt_id: o for o in run}
            picked = [by_id[ids[i]] for i in d]
            num = sum(len(o.token_ids) - o.prefill_steps for o in picked)
            den = sum(o.target_steps - o.prefill_steps for o in picked)
            row.append(num / den)
        out.append(row)
    return out


def test_tau_interval_and_difference_against_a_replicate_loop():
    import numpy as np
    from inference_eval.evaluation.metrics import tau_difference, tau_interval

    rng = random.Random(5)
    a = _prompts([[rng.randint(0, 3) for _ in range(rng.randint(2, 9))] for _ in range(15)])
    b = _prompts([[max(0, x - rng.randint(0, 1)) for x in acc]
                  for acc in ([int(s) for s in (o.accepted[1:])] for o in a)])
    loop = np.array(_loop_taus([a, b], 300, 4))
    lo, hi = tau_interval(a, reps=300, seed=4)
    assert [lo, hi] == pytest.approx(np.quantile(loop[:, 0], [0.025, 0.975]).tolist())
    assert lo < mean_accept_len(a) < hi
    d = tau_difference(a, b, reps=300, seed=4)
    assert d["prompts"] == 15
    assert d["diff"] == pytest.approx(mean_accept_len(a) - mean_accept_len(b))
    assert d["ci"] == pytest.approx(np.quantile(loop[:, 0] - loop[:, 1], [0.025, 0.975]).tolist())


def test_a_paired_difference_separates_what_two_intervals_do_not():
    """Prompts of very different τ, and a run ahead of the other by one accepted draft in
    every fifth round of every prompt: the two runs' own intervals overlap, the paired
    difference's interval lies above 0; the same run against itself differs by exactly 0."""
    from inference_eval.evaluation.metrics import tau_difference, tau_interval

    easy = [[3] * 10, [0] * 10, [2] * 10, [1] * 10] * 5
    better = [[min(3, x + (j % 5 == 0)) for j, x in enumerate(acc)] for acc in easy]
    a, b = _prompts(better), _prompts(easy)
    ia, ib = tau_interval(a), tau_interval(b)
    assert ia[0] < ib[1]  # overlapping intervals
    d = tau_difference(a, b)
    assert 0 < d["ci"][0] <= d["diff"] <= d["ci"][1]
    assert tau_difference(a, a) == {"diff": 0.0, "ci": [0.0, 0.0], "prompts": 20}
    # more prompts, a narrower interval; prompts only one run has are left out
    wide = tau_interval(b)
    narrow = tau_interval(b + _prompts(easy * 3, tag="q"))
    assert narrow[1] - narrow[0] < wide[1] - wide[0]
    assert tau_difference(a, b + _prompts([[1]], tag="x"))["prompts"] == 20
    assert tau_difference(a, _prompts([[1]], tag="x")) is None


def test_tau_intervals_without_rounds_are_none():
    from inference_eval.evaluation.metrics import tau_difference, tau_interval

    only_prefills = [_out([(0, 0)], pid="p0", prefills=1)]
    assert tau_interval(only_prefills) is None
    assert tau_difference(only_prefills, only_prefills) is None
    assert tau_interval([]) is None
