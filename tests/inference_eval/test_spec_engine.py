"""The speculative engine is lossless: greedy speculative output equals greedy autoregressive
output token for token, for head chains and LLM drafts, batched with mixed draft lengths, with
drafts that are accepted and rejected."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from heads.checkpoint import save_head
from heads.config import HeadConfig
from heads.registry import build_head
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.speculative.spec_engine import SpecEngine
from inference_eval.evaluation.engines import build_engine, frozen_parts_of
from inference_eval.engine.target import TargetConfig, load_target
from spec_stats import chi2_pvalue, first_two_counts, joint_first_two
from engine_cases import load_tiny as _loaded, random_prompts
from fit_head import fit_on_greedy
from tiny_hf_models import perturbed_copy


def _prompts(k=6, seed=21):
    return random_prompts(k, seed, 30, bos=None)


def _ar(loaded, prompts, params):
    eng = LLMEngine(loaded.model, None, EngineConfig(attention="torch", page_size=4))
    return [r.token_ids for r in eng.generate(prompts, params, progress=False)]


@pytest.fixture(scope="module")
def fitted_head(tiny_hf, tmp_path_factory):
    """An mtp head (one step, drafting K by reuse) fitted on the target's greedy continuations
    of _prompts(): it drafts what the target says often, not always (a random head accepts
    nothing, and a lossless test of it never runs the accept path)."""
    path = tmp_path_factory.mktemp("fitted") / "h"
    save_head(fit_on_greedy(_loaded(tiny_hf), _prompts()), path)
    return str(path)


def _drafts(out) -> tuple[int, int]:
    """(accepted, proposed) drafts over every round of every result."""
    return (sum(sum(r.meta["accepted"]) for r in out), sum(sum(r.meta["proposed"]) for r in out))


@pytest.mark.parametrize("num_draft", [1, 2, 4])
def test_head_chain_greedy_is_lossless(tiny_hf, fitted_head, num_draft):
    loaded = _loaded(tiny_hf)
    # Max lengths differ per prompt so K shrinks near the end for some requests only.
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 14, 20, 5, 17, 12)]
    prompts = _prompts()
    eng = build_engine(loaded, EngineConfig(attention="torch", page_size=4),
                      SimpleNamespace(kind="head", checkpoint=fitted_head, num_draft=num_draft,
                                      scheme="chain"))
    out = eng.generate(prompts, params, progress=False)
    assert [r.token_ids for r in out] == _ar(loaded, prompts, params)
    for r in out:  # metrics contract: one entry per target step, tokens = steps + accepted
        assert len(r.token_ids) <= sum(r.meta["accepted"]) + r.meta["target_steps"]
        assert max(r.meta["proposed"]) <= num_draft
    accepted, proposed = _drafts(out)
    assert 0.15 * proposed < accepted < proposed, (accepted, proposed)  # both paths ran


def test_llm_draft_equal_to_target_accepts_everything(tiny_hf):
    loaded = _loaded(tiny_hf)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = _prompts(3)
    eng = SpecEngine(loaded.model, None, EngineConfig(attention="torch", page_size=4),
                     lambda p, ps, d, dt: __import__("inference_eval.engine.speculative.drafters", fromlist=["x"])
                     .LLMDrafter(loaded.model, p, ps, d, dt), max_accepted=3)
    out = eng.generate(prompts, params, progress=False)
    assert [r.token_ids for r in out] == _ar(loaded, prompts, params)
    for r in out:
        assert r.meta["accepted"][1:] == r.meta["proposed"][1:]  # identical draft: all accepted
        assert r.meta["target_steps"] < 16


def test_llm_draft_other_model_is_lossless(tiny_hf, tmp_path):
    loaded = _loaded(tiny_hf, "llama3")
    other = tmp_path / "other"  # another checkpoint: the target's weights, perturbed
    perturbed_copy(tiny_hf("llama3")[1], other)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = _prompts(4, seed=5)
    eng = build_engine(loaded, EngineConfig(attention="torch", page_size=4),
                      SimpleNamespace(kind="llm", num_draft=3, scheme="chain",
                                      llm=TargetConfig(name="d", source="hf", path=str(other))))
    out = eng.generate(prompts, params, progress=False)
    assert [r.token_ids for r in out] == _ar(loaded, prompts, params)
    accepted, proposed = _drafts(out)
    assert 0.15 * proposed < accepted < proposed, (accepted, proposed)  # both paths ran


def test_head_for_another_target_is_refused(tiny_hf, tmp_path):
    from tiny_hf_models import make_tiny_hf

    make_tiny_hf("llama3", tmp_path / "other", seed=1)  # same shapes, other weights
    a = _loaded(tiny_hf, "llama3")
    b = load_target(TargetConfig(name="other", source="hf", path=str(tmp_path / "other")),
                    with_tokenizer=False)
    head = build_head(HeadConfig(type="mtp"), frozen_parts_of(a))
    save_head(head, tmp_path / "h")
    with pytest.raises(ValueError, match="other embedding/lm_head"):
        build_engine(b, EngineConfig(attention="torch"),
                    SimpleNamespace(kind="head", checkpoint=str(tmp_path / "h"), num_draft=2, scheme="chain"))


def test_too_many_draft_tokens_for_context(tiny_hf, tmp_path):
    loaded = _loaded(tiny_hf)
    with pytest.raises(ValueError, match="does not fit the context"):
        SpecEngine(loaded.model, None, EngineConfig(attention="torch", max_context=8),
                   lambda *a: None, max_accepted=7)


def test_sampled_speculation_matches_target_distribution(tiny_hf, tmp_path):
    """Temperature 0.8, top-k 4: the joint law of the first two generated tokens (the second
    one comes from a speculative round) equals the target's exact joint law."""
    loaded = _loaded(tiny_hf)
    head = build_head(HeadConfig(type="mtp"), frozen_parts_of(loaded), seed=5)
    with torch.no_grad():  # a head with some agreement, so both accept and reject paths run
        head.final_norm.weight.mul_(20.0)
    save_head(head, tmp_path / "h")
    prompt = _prompts(1, seed=9)[0]
    params = SamplingParams(temperature=0.8, top_k=4, max_new_tokens=3, ignore_eos=True)
    joint = joint_first_two(loaded.model, prompt, params)
    cfg = EngineConfig(attention="torch", page_size=4, max_batch_size=4096, seed=123)
    eng = build_engine(loaded, cfg, SimpleNamespace(kind="head", checkpoint=str(tmp_path / "h"),
                                                   num_draft=2, scheme="chain"))
    trials = 3000
    out = eng.generate([prompt] * trials, params, progress=False)
    counts = first_two_counts(out, 320)
    accepted = sum(r.meta["accepted"][1] for r in out)
    assert 0 < accepted < trials  # both branches were exercised
    assert chi2_pvalue(counts, joint) > 1e-4


def test_a_request_that_fails_after_preemption_leaves_no_drafter_state(tiny_hf):
    """A request that outgrows the whole cache is preempted, then failed when it cannot fit
    even alone: the drafter forgets it like a finished one."""
    from inference_eval.engine.speculative.drafters import LLMDrafter

    loaded = _loaded(tiny_hf)
    make = lambda p, ps, d, dt: LLMDrafter(loaded.model, p, ps, d, dt)  # noqa: E731
    eng = SpecEngine(loaded.model, None, EngineConfig(attention="torch", page_size=4, num_pages=6),
                     make, max_accepted=2)
    (r,) = eng.generate([_prompts(1, seed=3)[0][:8]], SamplingParams(max_new_tokens=40,
                                                                     ignore_eos=True), progress=False)
    assert r.error and "KV pages" in r.error and r.num_preemptions >= 1
    assert len(r.token_ids) > 4  # it ran rounds (and drafted) before it failed
    assert eng.drafter.cached == {}
