"""The embedded SmolLM2 target (9 heads, 3 KV heads) split over 3 gloo ranks, loaded from its
GGUF's converted cache slice by slice: greedy output identical to one process on held-out
prompts, and the same target fingerprints."""
from __future__ import annotations

import pytest

from tp_ranks import generate_greedy, leader_result, run_ranks
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.prompt_encoding import encode_prompt
from inference_eval.engine.target import TargetConfig, load_target

PROMPTS = ["Write a haiku about rivers.", "What is 17 times 3?",
           "Name three uses of a paperclip."]
ENGINE = dict(page_size=16, num_pages=64, max_batch_size=2)


@pytest.mark.slow
def test_smollm2_tp3_greedy_equals_one_process(tmp_path):
    loaded = load_target(TargetConfig())
    tok = loaded.tokenizer
    prompts = [encode_prompt(tok, p) for p in PROMPTS]  # followers have no tokenizer
    want = generate_greedy(LLMEngine(loaded.model, tok, EngineConfig(**ENGINE)), prompts, 12)
    identity = loaded.identity
    del loaded
    got = leader_result(run_ranks("smollm2_worker", 3, prompts, 12, ENGINE, tmp=tmp_path,
                                  timeout=300))
    assert got["tokens"] == want
    for key in ("weights_sha256", "frozen_sha256"):
        assert got["identity"][key] == identity[key], key
