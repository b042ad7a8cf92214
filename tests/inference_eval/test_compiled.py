"""Compiled small-row steps (engine.compile, model/compiled.py) against the eager engine."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.model.compiled import CompiledSteps, compilable
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.speculative.drafters import LLMDrafter
from inference_eval.engine.speculative.spec_engine import SpecEngine
from inference_eval.engine.target import TargetConfig, load_target
from engine_cases import load_tiny as _loaded, random_prompts

CFG = dict(attention="torch", page_size=4)
CONF = Path(__file__).resolve().parents[2] / "conf" / "target"


def _prompts(k, seed=31):
    return random_prompts(k, seed, 20)


@pytest.fixture(scope="module")
def compiled_pair(tiny_hf):
    """An eager and a compiled copy of the same tiny target (separate models: one model's
    compiled steps serve every engine built on it)."""
    eager, comp = _loaded(tiny_hf), _loaded(tiny_hf)
    eng = LLMEngine(comp.model, None, EngineConfig(compile=True, **CFG), lookahead=3)
    eng.warm(1)  # rows 1..3: decode and a K=2 verification
    return eager, comp


def test_compiled_logits_equal_eager_on_a_paged_cache(compiled_pair):
    eager, comp = compiled_pair
    assert comp.model.compiled.rows == {((), 1), ((), 2), ((), 3)}
    ids = torch.tensor(_prompts(1)[0] + [7, 8, 9])
    n = ids.numel()
    outs = []
    for loaded, use in ((eager, False), (comp, True)):
        m = loaded.model
        eng = LLMEngine(m, None, EngineConfig(compile=use, **CFG))
        pages = list(range(n // 4 + 1))
        ctx = n - 3
        with torch.inference_mode():  # an eager prefill, then a three-row verification
            m(ids[:ctx], eng.backend.plan(BatchLayout([ctx], [ctx], [pages], 4)), eng.cache,
              compute_logits=False)
            v = m(ids[ctx:], eng.backend.plan(BatchLayout([3], [n], [pages], 4)), eng.cache)
        outs.append((v.logits, v.hidden))
    (le, he), (lc, hc) = outs
    assert lc.shape == le.shape == (3, eager.model.arch.vocab_size)
    torch.testing.assert_close(lc, le, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hc, he, rtol=1e-4, atol=1e-4)
    assert lc.argmax(-1).tolist() == le.argmax(-1).tolist()


def test_compiled_greedy_generation_equals_eager(compiled_pair):
    eager, comp = compiled_pair
    prompts = _prompts(3, seed=5)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    ref = [r.token_ids for r in LLMEngine(eager.model, None, EngineConfig(**CFG)).generate(
        prompts, params, progress=False)]
    # Batch 3 decodes 3 rows a step: a compiled shape, with the prefill run eagerly.
    eng = LLMEngine(comp.model, None, EngineConfig(compile=True, **CFG))
    assert [r.token_ids for r in eng.generate(prompts, params, progress=False)] == ref


def test_engine_steps_after_warm_compile_nothing(compiled_pair):
    # Steps check only the guards telling row counts apart (compiled._checking_only_row_guards);
    # an engine's own steps must match what warm compiled, so a timed run never compiles.
    from torch._dynamo.utils import counters

    _, comp = compiled_pair
    before = dict(counters["stats"])
    eng = LLMEngine(comp.model, None, EngineConfig(compile=True, **CFG))
    eng.generate(_prompts(3, seed=7), SamplingParams(max_new_tokens=6, ignore_eos=True),
                 progress=False)
    assert counters["stats"]["unique_graphs"] == before.get("unique_graphs", 0)
    assert counters["stats"]["calls_captured"] == before.get("calls_captured", 0)


def test_compiled_speculative_rounds_accept_and_stay_lossless(compiled_pair):
    """Self-drafting (the target is its own draft) accepts every draft: K=2 rounds verify 3
    rows through the compiled graph; output equals autoregressive decoding."""
    eager, comp = compiled_pair
    prompt = _prompts(1, seed=9)[0]
    params = SamplingParams(max_new_tokens=13, ignore_eos=True)
    ref = LLMEngine(eager.model, None, EngineConfig(**CFG)).generate([prompt], params,
                                                                     progress=False)[0].token_ids
    make = lambda p, ps, d, dt: LLMDrafter(comp.model, p, ps, d, dt)  # noqa: E731
    eng = SpecEngine(comp.model, None, EngineConfig(compile=True, **CFG), make, max_accepted=2)
    (r,) = eng.generate([prompt], params, progress=False)
    assert r.token_ids == ref
    assert sum(r.meta["accepted"]) >= 8 and r.meta["accepted"][1] == 2


@pytest.fixture(scope="module")
def fitted(compiled_pair, tmp_path_factory):
    """A head fitted on the target's own text (it accepts), its prompts and the AR output."""
    from heads.checkpoint import save_head
    from fit_head import fit_head_on

    eager, _ = compiled_pair
    prompts = _prompts(3, seed=21)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ar = LLMEngine(eager.model, None, EngineConfig(**CFG)).generate(prompts, params, progress=False)
    path = tmp_path_factory.mktemp("head") / "mtp"
    save_head(fit_head_on(eager, [r.prompt_ids + r.token_ids for r in ar]), path)
    return str(path), prompts, params, ar


def _eager_and_compiled(compiled_pair, draft, prompts, params):
    from inference_eval.evaluation.engines import build_engine

    runs, engines = [], []
    for loaded, use in zip(compiled_pair, (False, True)):
        eng = build_engine(loaded, EngineConfig(compile=use, **CFG), draft)
        runs.append([eng.generate([p], params, progress=False)[0] for p in prompts])
        engines.append(eng)
    return runs, engines[1]


def test_compiled_head_drafts_like_the_eager_head(compiled_pair, fitted):
    """Eager vs compiled target and head steps: the same tokens (= autoregressive), the same
    accepted lengths round by round."""
    ck, prompts, params, ar = fitted
    draft = SimpleNamespace(kind="head", checkpoint=ck, num_draft=2, scheme="chain",
                            sync_free=False)
    (eager_out, comp_out), eng = _eager_and_compiled(compiled_pair, draft, prompts, params)
    h = compiled_pair[1].model.arch.hidden_size
    assert eng.drafter.compiled.rows == {((h,), 1), ((h,), 2), ((h,), 3)}
    assert [r.token_ids for r in comp_out] == [r.token_ids for r in ar]
    assert [r.meta["accepted"] for r in comp_out] == [r.meta["accepted"] for r in eager_out]
    proposed = sum(sum(r.meta["proposed"]) for r in comp_out)
    assert sum(sum(r.meta["accepted"]) for r in comp_out) > 0.3 * proposed


def test_compiled_tree_rounds_equal_the_eager_tree(compiled_pair, fitted):
    """An EAGLE-2 tree (depth 2, 2 children, 4 nodes): verification of 5 rows and the head's
    frontier steps run compiled; tokens and accepted lengths are the eager tree's."""
    ck, prompts, params, ar = fitted
    draft = SimpleNamespace(kind="head", checkpoint=ck, scheme="tree", depth=2, topk=2,
                            total_tokens=4)
    (eager_out, comp_out), eng = _eager_and_compiled(compiled_pair, draft, prompts, params)
    assert ((), 5) in compiled_pair[1].model.compiled.rows
    assert {t for _, t in eng.drafter.compiled.rows} >= {1, 2, 3}
    assert [r.token_ids for r in comp_out] == [r.token_ids for r in ar]
    assert [r.meta["accepted"] for r in comp_out] == [r.meta["accepted"] for r in eager_out]
    assert sum(sum(r.meta["accepted"]) for r in comp_out) > 0


def test_compile_refuses_what_it_cannot_run(tiny_hf):
    from omegaconf import OmegaConf

    loaded = _loaded(tiny_hf)
    assert compilable(loaded.model)
    with pytest.raises(ValueError, match="engine.compile=false"):
        CompiledSteps(loaded.model.to(torch.float64))
    conf = OmegaConf.to_container(OmegaConf.load(CONF / "tiny_deepseek.yaml"))
    deepseek = load_target(TargetConfig(name="d", source="random", arch=conf["arch"]),
                           with_tokenizer=False)
    assert not compilable(deepseek.model)  # MLA and MoE layers stay eager
    with pytest.raises(ValueError, match="dense GQA"):
        LLMEngine(deepseek.model, None, EngineConfig(compile=True, **CFG))
