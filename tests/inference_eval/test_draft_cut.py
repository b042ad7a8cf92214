"""The draft cuts' rules (engine/speculative/draft_cut.py) against plain references: the rate
rule keeps drafts up to the first local maximum of a round's expected tokens per cost, its
calibration counts what the target judged, and bad settings are refused with the key named.
The engine runs of the rules (lossless, greedy and sampled) are in test_confident_chains.py."""
from __future__ import annotations

import random

import pytest

from inference_eval.engine.speculative.draft_cut import (EXPLORE, PRIOR, Calibration, DraftCut,
                                                          round_costs)


def _rate(costs: list[float], k: int) -> DraftCut:
    """A rate cut past its first (exploring) round."""
    cut = DraftCut("rate", round_costs=costs, max_drafts=k)
    cut.begin(1)
    return cut


def _run(cut: DraftCut, confs: list[float]) -> int:
    """Drafts one request keeps in one round offered `confs` (stops at the first refusal)."""
    state = cut.begin(1)
    for s, c in enumerate(confs):
        if not cut.keep(state, [0], [c])[0]:
            return s
    return len(confs)


def _first_peak(rates: list[float], costs: list[float]) -> int:
    """Reference: E(s) / cost(s) over s = 0..K from the acceptance rates; the kept count is
    the first s after which the ratio stops rising."""
    ratio, e, p = [1.0 / costs[0]], 1.0, 1.0
    for s, a in enumerate(rates, 1):
        p *= a
        e += p
        ratio.append(e / costs[s])
    for s in range(len(rates)):
        if ratio[s + 1] <= ratio[s]:
            return s
    return len(rates)


def test_rate_rule_keeps_drafts_to_the_first_peak_of_tokens_per_cost():
    rng = random.Random(0)
    seen = set()
    for _ in range(400):
        k = rng.randint(1, 6)
        step = [rng.uniform(0.0, 0.4) for _ in range(k)]
        costs = [1.0 + rng.uniform(0, 0.2)]
        for d in step:
            costs.append(costs[-1] + d)
        confs = [rng.random() for _ in range(k)]
        got = _run(_rate(costs, k), confs)  # no rounds judged yet: the rates are the confidences
        assert got == _first_peak(confs, costs)
        seen.add((got == 0, got == k))
    assert seen >= {(True, False), (False, True), (False, False)}  # none, all, and some kept


def test_rate_rule_follows_the_cost_of_a_row():
    confs = [0.3, 0.2, 0.1, 0.05]
    flat = _rate([1.0] * 5, 4)
    assert _run(flat, confs) == 4  # verifying is free: any chance pays
    cpu = _rate([1.1, 1.2, 1.33, 1.46, 1.6], 4)
    assert _run(cpu, [0.5, 0.4, 0.1, 0.05]) == 2  # +0.5, +0.2 tokens pay for a row; +0.02 not
    steep = _rate([1.0, 2.0, 3.0, 4.0, 5.0], 4)
    assert _run(steep, confs) == 0
    assert _run(cpu, [0.9, 0.9, 0.9, 0.9, 0.9]) == 4  # never past the costs given


def test_calibration_counts_the_judged_drafts_and_corrects_confidences():
    cal = Calibration()
    assert cal.rate(0.37) == pytest.approx(0.37)  # unjudged: the confidence itself
    cal.observe([0.95, 0.95, 0.95], accepted=1)  # d_1 accepted, d_2 rejected, d_3 never judged
    top = Calibration.bin(0.95)
    assert (cal.judged[top], cal.accepted[top]) == (2, 1)
    assert sum(cal.judged) == 2
    # An overconfident drafter: drafts at 0.95 rejected round after round.
    cut = _rate([1.0, 1.1, 1.2], 2)
    assert _run(cut, [0.95, 0.95]) == 2
    state = cut.begin(1)
    cut.keep(state, [0], [0.95])
    cut.end(state, [0])  # the round's verdict reaches the calibration
    assert cut.calibration.judged[top] == 1 and cut.calibration.accepted[top] == 0
    for _ in range(49):
        cut.calibration.observe([0.95], accepted=0)
    want = PRIOR * 0.95 / (50 + PRIOR)
    assert cut.calibration.rate(0.95) == pytest.approx(want)
    cut.rounds = 1
    assert _run(cut, [0.95, 0.95]) == 0  # learnt: such drafts no longer pay
    assert cut.calibration.rate(0.15) == pytest.approx(0.15)  # other bins untouched


def test_every_few_rounds_the_first_draft_is_judged_anyway():
    """A bin the rule refuses is never judged again unless a round explores: rounds 0, EXPLORE,
    2 EXPLORE ... keep each request's first draft (and only the first, here)."""
    cut = DraftCut("rate", round_costs=[1.0, 2.0, 3.0], max_drafts=2)
    kept = [_run(cut, [0.3, 0.3]) for _ in range(2 * EXPLORE + 1)]
    assert kept == [1 if i % EXPLORE == 0 else 0 for i in range(2 * EXPLORE + 1)]
    state = cut.begin(2)  # round 2 EXPLORE + 1: no exploring
    assert cut.keep(state, [0, 1], [0.3, 0.99]) == [False, False]


def test_threshold_rules_and_batches():
    cut = DraftCut("draft", min_confidence=0.5)
    state = cut.begin(3)
    assert cut.keep(state, [0, 2], [0.6, 0.4]) == [True, False]
    assert cut.keep(state, [0], [0.7]) == [True]
    prefix = DraftCut("prefix", min_confidence=0.5)
    state = prefix.begin(2)
    assert prefix.keep(state, [0, 1], [0.8, 0.9]) == [True, True]
    assert prefix.keep(state, [0, 1], [0.6, 0.6]) == [False, True]  # 0.48 and 0.54 vs 0.5
    assert prefix.keep(state, [1], [0.95]) == [True]                 # 0.513
    assert prefix.keep(state, [1], [0.9]) == [False]                 # 0.46
    assert not DraftCut("draft").active and DraftCut("draft", 0.1).active
    assert DraftCut("rate", round_costs=[1, 1], max_drafts=1).active


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match="round_costs: 5 costs"):
        DraftCut("rate", max_drafts=4)
    with pytest.raises(ValueError, match="round_costs: 5 costs"):
        DraftCut("rate", round_costs=[1.0, 1.1], max_drafts=4)
    with pytest.raises(ValueError, match="must be > 0"):
        DraftCut("rate", round_costs=[1.0, 0.0], max_drafts=1)
    with pytest.raises(ValueError, match="rate only"):
        DraftCut("draft", 0.2, round_costs=[1.0, 1.1])
    with pytest.raises(ValueError, match="not draft.min_confidence"):
        DraftCut("rate", 0.2, round_costs=[1.0, 1.1])
    with pytest.raises(ValueError, match="set it in"):
        DraftCut("prefix")
    with pytest.raises(ValueError, match="use one of"):
        DraftCut("product", 0.5)


def test_round_costs_from_measured_parts():
    """The costs the rate rule reads, from a machine's parts (ms; verify[s]: s + 1 rows): a
    chain pays its refill and a step per kept draft but the last, P-EAGLE its mask pass only
    once d_1 is kept, DFlash its context write and pass every round; in AR steps."""
    verify = [10.0, 12.0, 13.0, 14.0, 15.0]
    chain = round_costs(verify, 1.0, step=0.5)
    assert chain == pytest.approx([1.1, 1.35, 1.5, 1.65, 1.75])
    assert round_costs(verify, 1.0, kept=2.0) == pytest.approx([1.1, 1.5, 1.6, 1.7, 1.8])
    assert round_costs(verify[:4], 3.0) == pytest.approx([1.3, 1.5, 1.6, 1.7])
    assert round_costs(verify, 0.0, step=1.0, max_steps=4)[4] == pytest.approx(1.9)
