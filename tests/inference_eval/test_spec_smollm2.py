"""Lossless speculation on the real SmolLM2 target with a trained head: greedy chain and tree
output equals greedy autoregressive output token for token, with drafts actually accepted.

The head is trained in the test (seconds): on the target's own greedy continuations of two
prompts, with the soft targets recomputed by the engine's target, so it has learned exactly
the predictions it will be asked to draft and its acceptance is far above chance."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from heads.checkpoint import save_head
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.sampling import SamplingParams
from inference_eval.evaluation.engines import build_engine
from fit_head import fit_head_on

PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The three primary colors are"]


@pytest.mark.slow
def test_trained_head_chain_and_tree_are_lossless_on_smollm2(smollm2, tmp_path):
    loaded, _ = smollm2
    prompts = [loaded.tokenizer(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = [r.token_ids for r in LLMEngine(loaded.model, None, EngineConfig()).generate(
        prompts, params, progress=False)]

    head = fit_head_on(loaded, [p + o for p, o in zip(prompts, ar)], steps=30, lr=2e-3)
    save_head(head, tmp_path / "h")

    for cfg in (SimpleNamespace(kind="head", checkpoint=str(tmp_path / "h"), scheme="chain", num_draft=2),
                SimpleNamespace(kind="head", checkpoint=str(tmp_path / "h"), scheme="tree", num_draft=3,
                                depth=3, topk=3, total_tokens=8)):
        out = build_engine(loaded, EngineConfig(), cfg).generate(prompts, params, progress=False)
        assert [r.token_ids for r in out] == ar, cfg.scheme
        proposed = sum(sum(r.meta["proposed"]) for r in out)
        accepted = sum(sum(r.meta["accepted"]) for r in out)
        assert accepted > 0.3 * proposed, (cfg.scheme, accepted, proposed)
