"""Chains cut by the draft's confidence (draft.min_confidence): a request stops drafting at
the first draft whose law's top probability is below the threshold. Greedy output stays the
autoregressive output, the sampled law stays the target's, and the cut drafts are the
unlikely ones (the acceptance rate of what is proposed rises)."""
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
from inference_eval.engine.speculative.spec_engine import SpecEngine
from spec_stats import chi2_pvalue, first_two_counts, joint_first_two
from engine_cases import load_tiny as _loaded, random_prompts

CFG = dict(attention="torch", page_size=4)


def _prompts(k, seed):
    return random_prompts(k, seed, 20, bos=None)


def _chain(path, k, conf):
    return SimpleNamespace(kind="head", checkpoint=path, num_draft=k, scheme="chain",
                           min_confidence=conf)


def test_confidence_cut_is_lossless_and_cuts_the_unlikely_drafts(tiny_hf, tmp_path):
    loaded = _loaded(tiny_hf)
    prompts = _prompts(4, seed=13)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ar = LLMEngine(loaded.model, None, EngineConfig(**CFG)).generate(prompts, params, progress=False)
    # Fitted on half of the answers: confident (and right) there, unsure on the rest.
    seqs = [p + r.token_ids[:10] for p, r in zip(prompts, ar)]
    save_head(fit_head_on(loaded, seqs), tmp_path / "h")
    # The tiny random target's laws are nearly flat (top probabilities ~0.01 over 320
    # tokens), so the cut sits at the median of this head's own confidences.
    seen = []
    real = SpecEngine._confident

    def spy(self, logits, rows):
        seen.extend(torch.softmax(logits.float(), -1).max(-1).values.tolist())
        return real(self, logits, rows)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SpecEngine, "_confident", spy)
        build_engine(loaded, EngineConfig(**CFG), _chain(str(tmp_path / "h"), 3, 0.0)).generate(
            prompts, params, progress=False)
    median = float(torch.tensor(seen).median())
    stats = {}
    for conf in (0.0, median, 0.5):
        eng = build_engine(loaded, EngineConfig(**CFG), _chain(str(tmp_path / "h"), 3, conf))
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


def test_confidence_cut_keeps_the_sampled_law(tiny_hf, tmp_path):
    """Temperature 0.8, top-k 4, a peaked random head cut at 0.6: the joint law of the first
    two generated tokens is the target's (the second token's round has one draft: cut, a plain
    decode step; kept, a verification), and both kinds of round ran."""
    loaded = _loaded(tiny_hf)
    head = build_head(HeadConfig(type="mtp"), frozen_parts_of(loaded), seed=5)
    with torch.no_grad():
        head.final_norm.weight.mul_(20.0)
    save_head(head, tmp_path / "h")
    prompt = _prompts(1, seed=9)[0]
    params = SamplingParams(temperature=0.8, top_k=4, max_new_tokens=3, ignore_eos=True)
    joint = joint_first_two(loaded.model, prompt, params)
    cfg = EngineConfig(max_batch_size=4096, seed=7, **CFG)
    eng = build_engine(loaded, cfg, _chain(str(tmp_path / "h"), 2, 0.6))
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
    assert DraftConfig(kind="head", checkpoint="x", lookup=True, min_confidence=0.5).min_confidence == 0.5
