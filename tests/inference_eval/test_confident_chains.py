"""Chains cut by the draft's confidence (draft.min_confidence): a request stops drafting at
the first draft whose law's top probability is below the threshold (confidence_cut=prefix:
whose product with the round's earlier ones is; confidence_cut=rate: the first that does not
raise the round's expected tokens per cost, DSpark's scheduler). Greedy output stays the
autoregressive output, the sampled law stays the target's, and the cut drafts are the unlikely
ones (the acceptance rate of what is proposed rises)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fit_head import fit_head_on
from heads.checkpoint import save_head
from heads.config import HeadConfig
from heads.registry import build_head
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.sampling import SamplingParams
from inference_eval.evaluation.config import DraftConfig
from inference_eval.evaluation.engines import build_engine, frozen_parts_of
from inference_eval.engine.speculative.draft_cut import EXPLORE, PRIOR
from inference_eval.engine.speculative.spec_engine import SpecEngine
from spec_stats import chi2_pvalue, first_two_counts, joint_first_two
from engine_cases import load_tiny as _loaded, random_prompts

CFG = dict(attention="torch", page_size=4)


def _prompts(k, seed):
    return random_prompts(k, seed, 20, bos=None)


def _chain(path, k, conf, cut="draft", costs=None):
    return SimpleNamespace(kind="head", checkpoint=path, num_draft=k, scheme="chain",
                           min_confidence=conf, confidence_cut=cut, round_costs=costs)


def _fitted(tiny_hf, tmp_path):
    """(loaded, prompts, params, autoregressive outputs, head dir): a head fitted on the first
    half of the answers, confident (and right) there, unsure on the rest."""
    loaded = _loaded(tiny_hf)
    prompts = _prompts(4, seed=13)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ar = LLMEngine(loaded.model, None, EngineConfig(**CFG)).generate(prompts, params, progress=False)
    seqs = [p + r.token_ids[:10] for p, r in zip(prompts, ar)]
    save_head(fit_head_on(loaded, seqs), tmp_path / "h")
    return loaded, prompts, params, ar, str(tmp_path / "h")


class _Spy:
    """Patches SpecEngine to record, per round, each draft step's rows' top probabilities
    (computed here from the laws) and the cut's verdicts: rounds [[(tops, verdicts), ...]]."""

    def __init__(self, mp: pytest.MonkeyPatch) -> None:
        self.rounds: list[list[tuple[list[float], list[bool]]]] = []
        propose, confident = SpecEngine._propose, SpecEngine._confident

        def _propose(engine, *args):
            self.rounds.append([])
            return propose(engine, *args)

        def _confident(engine, logits, live, run):
            verdicts = confident(engine, logits, live, run)
            self.rounds[-1].append((torch.softmax(logits.float(), -1).max(-1).values.tolist(),
                                    verdicts))
            return verdicts
        mp.setattr(SpecEngine, "_propose", _propose)
        mp.setattr(SpecEngine, "_confident", _confident)

    def tops(self) -> torch.Tensor:
        return torch.tensor([c for r in self.rounds for tops, _ in r for c in tops])


def test_confidence_cut_is_lossless_and_cuts_the_unlikely_drafts(tiny_hf, tmp_path):
    loaded, prompts, params, ar, head = _fitted(tiny_hf, tmp_path)
    # The tiny random target's laws are nearly flat (top probabilities ~0.01 over 320
    # tokens), so the cut sits at the median of this head's own confidences.
    with pytest.MonkeyPatch.context() as mp:
        spy = _Spy(mp)
        build_engine(loaded, EngineConfig(**CFG), _chain(head, 3, 1e-9)).generate(
            prompts, params, progress=False)
    median = float(spy.tops().median())
    stats = {}
    for conf in (0.0, median, 0.5):
        eng = build_engine(loaded, EngineConfig(**CFG), _chain(head, 3, conf))
        out = eng.generate(prompts, params, progress=False)
        assert [r.token_ids for r in out] == [r.token_ids for r in ar]
        rounds = [(p, a) for r in out for p, a in zip(r.meta["proposed"][1:], r.meta["accepted"][1:])]
        stats[conf] = (sum(p for p, _ in rounds), sum(a for _, a in rounds),
                       {p for p, _ in rounds})
    (p0, a0, _), (p5, a5, kinds5), (p1, a1, _) = stats[0.0], stats[median], stats[0.5]
    assert a0 > 0 and p5 < p0 and a5 > 0
    assert a5 / p5 > a0 / p0  # what the cut removed was mostly rejected
    assert min(kinds5) < 3 and 3 in kinds5  # some rounds cut, some drafted all 3
    assert p1 == a1 == 0  # nothing is that sure here: plain decode steps


def test_prefix_cut_stops_at_the_first_product_below_the_threshold(tiny_hf, tmp_path):
    """confidence_cut=prefix, one prompt at a time: every round's proposals are what a replay
    of the rule gives from the top probabilities its steps saw (drafts kept while the round's
    running product reaches the threshold, the first one below it ends the round); some
    round's cut comes from the product alone (every draft of it passes on its own); greedy
    output is the autoregressive output, and at the same threshold the prefix cut proposes
    fewer drafts than the per-draft cut, with more of them accepted."""
    loaded, prompts, params, ar, head = _fitted(tiny_hf, tmp_path)
    with pytest.MonkeyPatch.context() as mp:
        spy = _Spy(mp)
        build_engine(loaded, EngineConfig(**CFG), _chain(head, 3, 1e-9)).generate(
            prompts, params, progress=False)
    t = float(spy.tops().quantile(0.25))
    totals, by_product = {}, 0
    for cut in ("draft", "prefix"):
        proposed = accepted = 0
        for prompt, want in zip(prompts, ar):
            with pytest.MonkeyPatch.context() as mp:
                spy = _Spy(mp)
                eng = build_engine(loaded, EngineConfig(**CFG), _chain(head, 3, t, cut))
                (out,) = eng.generate([prompt], params, progress=False)
            assert out.token_ids == want.token_ids
            kept = []  # per round: the drafts the replayed rule keeps
            for steps in spy.rounds:
                prod, alone = 1.0, True
                for s, ((c,), (verdict,)) in enumerate(steps):
                    prod *= c
                    alone = alone and c >= t
                    assert verdict == ((prod if cut == "prefix" else c) >= t)
                    if not verdict:  # the round's drafting ends at its first cut
                        assert s == len(steps) - 1
                        by_product += cut == "prefix" and alone
                kept.append(sum(v for _, (v,) in steps))
            assert out.meta["proposed"][1:] == kept
            proposed += sum(kept)
            accepted += sum(out.meta["accepted"][1:])
        totals[cut] = (proposed, accepted)
    (pd, ad), (pp, ap) = totals["draft"], totals["prefix"]
    assert by_product > 0 and 0 < pp < pd and ap / pp > ad / pd


def _rate_replay(steps, costs, judged, hits, explore) -> int:
    """The rate rule replayed for one round from its steps' top probabilities, with the
    calibration counts so far (judged / hits per tenth of confidence, updated by the caller):
    the drafts kept (an exploring round keeps its first)."""
    e, p = 1.0, 1.0
    for s, ((c,), _) in enumerate(steps, 1):
        b = min(int(c * 10), 9)
        a = (hits[b] + PRIOR * c) / (judged[b] + PRIOR)
        pays = (e + p * a) / costs[s] > e / costs[s - 1] if s < len(costs) else False
        if not (pays or (explore and s == 1)):
            return s - 1
        e, p = e + p * a, p * a
    return len(steps)


def test_rate_cut_replays_the_rule_learns_and_stays_lossless(tiny_hf, tmp_path):
    """confidence_cut=rate, one prompt at a time, costs of a CPU-like round (each verified row
    0.1 AR steps): every round keeps what a replay of the rule gives from the top
    probabilities its steps saw, the acceptances of the rounds before (its calibration) and
    the exploring rounds; greedy output is the autoregressive output. The tiny target's laws
    are nearly flat (the head's confidences ~0.01) though the head is often right, so drafts
    are accepted only because the calibration learns that; rounds are cut, and with free rows
    (a GPU's flat costs) it drafts more, with fewer of them accepted."""
    loaded, prompts, params, ar, head = _fitted(tiny_hf, tmp_path)
    costs = [1.0, 1.1, 1.2, 1.3]
    totals = {}
    for name, cost in (("cpu", costs), ("flat", [1.0] * 4)):
        proposed = accepted = 0
        kinds = set()
        for prompt, want in zip(prompts, ar):
            with pytest.MonkeyPatch.context() as mp:
                spy = _Spy(mp)
                eng = build_engine(loaded, EngineConfig(**CFG), _chain(head, 3, 0.0, "rate", cost))
                (out,) = eng.generate([prompt], params, progress=False)
            assert out.token_ids == want.token_ids
            judged, hits = [0] * 10, [0] * 10
            rounds = zip(spy.rounds, out.meta["proposed"][1:], out.meta["accepted"][1:])
            for i, (steps, p, a) in enumerate(rounds):
                assert p == _rate_replay(steps, cost, judged, hits, i % EXPLORE == 0)
                for s, ((c,), _) in enumerate(steps[:min(p, a + 1)]):
                    judged[min(int(c * 10), 9)] += 1
                    hits[min(int(c * 10), 9)] += s < a
                kinds.add(p)
            proposed += sum(out.meta["proposed"][1:])
            accepted += sum(out.meta["accepted"][1:])
        totals[name] = (proposed, accepted, kinds)
    (pc, ac, kc), (pf, af, _) = totals["cpu"], totals["flat"]
    assert ac > 0 and min(kc) < 3
    assert pf > pc and ac / pc > af / pf


@pytest.mark.parametrize("cut,conf,costs", [("draft", 0.6, None), ("rate", 0.0, [1.0, 1.6, 2.2])])
def test_confidence_cut_keeps_the_sampled_law(tiny_hf, tmp_path, cut, conf, costs):
    """Temperature 0.8, top-k 4, a peaked random head cut at 0.6 (or by the rate rule with a
    second row costing 0.6 AR steps: kept when the draft's confidence passes 0.6 too): the
    joint law of the first two generated tokens is the target's (the second token's round has
    one draft: cut, a plain decode step; kept, a verification), and both kinds of round ran."""
    loaded = _loaded(tiny_hf)
    head = build_head(HeadConfig(type="mtp"), frozen_parts_of(loaded), seed=5)
    with torch.no_grad():
        head.final_norm.weight.mul_(20.0)
    save_head(head, tmp_path / "h")
    prompt = _prompts(1, seed=9)[0]
    params = SamplingParams(temperature=0.8, top_k=4, max_new_tokens=3, ignore_eos=True)
    joint = joint_first_two(loaded.model, prompt, params)
    cfg = EngineConfig(max_batch_size=4096, seed=7, **CFG)
    eng = build_engine(loaded, cfg, _chain(str(tmp_path / "h"), 2, conf, cut, costs))
    trials = 3000
    out = eng.generate([prompt] * trials, params, progress=False)
    proposed = [r.meta["proposed"][1] for r in out]
    assert 0 < proposed.count(0) < trials and 0 < proposed.count(1)  # cut rounds and drafted ones
    assert chi2_pvalue(first_two_counts(out, 320), joint) > 1e-4


def test_min_confidence_config_refusals():
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        DraftConfig(kind="head", checkpoint="x", min_confidence=1.0)
    with pytest.raises(ValueError, match="model-drafted chains"):
        DraftConfig(kind="head", checkpoint="x", scheme="tree", min_confidence=0.5)
    with pytest.raises(ValueError, match="model-drafted chains"):
        DraftConfig(kind="lookup", min_confidence=0.5)
    with pytest.raises(ValueError, match="use one of"):
        DraftConfig(kind="head", checkpoint="x", min_confidence=0.5, confidence_cut="product")
    with pytest.raises(ValueError, match="set it in"):
        DraftConfig(kind="head", checkpoint="x", confidence_cut="prefix")
    with pytest.raises(ValueError, match="round_costs: 5 costs"):
        DraftConfig(kind="head", checkpoint="x", confidence_cut="rate")
    with pytest.raises(ValueError, match="model-drafted chains"):
        DraftConfig(kind="lookup", confidence_cut="rate", round_costs=[1.0] * 5)
    rate = DraftConfig(kind="head", checkpoint="x", num_draft=2, confidence_cut="rate",
                       round_costs=[1.0, 1.1, 1.2])
    assert rate.round_costs == [1.0, 1.1, 1.2]
    assert DraftConfig(kind="head", checkpoint="x", lookup=True, min_confidence=0.5).min_confidence == 0.5
