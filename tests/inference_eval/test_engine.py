"""The engine's generate path: HF greedy parity, batching, preemption, bad input."""
from __future__ import annotations

import pytest
import torch

from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.target import TargetConfig, load_target

PROMPTS = [
    "Write a python function that reverses a string.",
    "What is the capital of France?",
    "Tell me a short joke about cats.",
    "Explain gravity to a child in one sentence.",
    "List three primary colors.",
    "How do I sort a list in Python?",
    "Say hello in German.",
    "What is 17 times 3?",
]


def _tiny_engine(tiny_hf, family="llama3", **cfg):
    hf_dir, hf = tiny_hf(family)
    model = load_target(TargetConfig(source="hf", path=str(hf_dir)), with_tokenizer=False).model
    return LLMEngine(model, None, EngineConfig(attention="torch", **cfg)), hf


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    # No eos at all (min_new_tokens would mask eos logits instead): matches ignore_eos.
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(ids) + n
    return out[0, len(ids):].tolist()


def _random_prompts(k: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (int(torch.randint(2, 40, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(k)]


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_tiny_greedy_equals_hf_generate(family, tiny_hf):
    eng, hf = _tiny_engine(tiny_hf, family, page_size=4)
    prompts = _random_prompts(8)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    batched = eng.generate(prompts, params, progress=False)
    for p, r in zip(prompts, batched):
        assert r.token_ids == _hf_greedy(hf, p, 12)


def test_batched_paged_path_equals_per_request_loop(tiny_hf):
    prompts = _random_prompts(6, seed=5)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    eng, _ = _tiny_engine(tiny_hf, page_size=4, max_batched_tokens=64)
    batched = [r.token_ids for r in eng.generate(prompts, params, progress=False)]
    one_by_one = []
    for p in prompts:
        e, _ = _tiny_engine(tiny_hf, page_size=4)
        one_by_one.append(e.generate([p], params, progress=False)[0].token_ids)
    assert batched == one_by_one


def test_page_exhaustion_preempts_and_stays_exact(tiny_hf):
    prompts = _random_prompts(6, seed=7)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    roomy, _ = _tiny_engine(tiny_hf, page_size=4)
    ref = [r.token_ids for r in roomy.generate(prompts, params, progress=False)]
    # 20 pages x 4 tokens cannot hold six requests of up to 63 tokens at once.
    tight, _ = _tiny_engine(tiny_hf, page_size=4, num_pages=20)
    out = tight.generate(prompts, params, progress=False)
    assert [r.token_ids for r in out] == ref
    assert sum(r.num_preemptions for r in out) > 0
    assert tight.allocator.num_free == 20  # every page returned


def test_bad_prompts_fail_alone(tiny_hf):
    eng, hf = _tiny_engine(tiny_hf, page_size=4, max_context=64)
    good = _random_prompts(2, seed=11)
    prompts = [good[0], [], list(range(3, 100)), [5, 999999], good[1]]
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    out = eng.generate(prompts, params, progress=False)
    assert "empty" in out[1].error and "prompt 1" in out[1].error
    assert "context" in out[2].error and "97 tokens" in out[2].error
    assert "outside the vocabulary" in out[3].error
    for i in (0, 4):
        assert out[i].error is None and out[i].token_ids == _hf_greedy(hf, prompts[i], 5)


def test_request_larger_than_cache_fails_with_reason(tiny_hf):
    """4 pages x 4 tokens = 16 slots. Request 1's prompt (30 tokens) is refused on arrival.
    Request 0 (10 + 20 tokens) runs until its 7th output token finds no slot (10 + 6 cached),
    is preempted, then fails as it cannot fit even alone: its 7 tokens are the free run's."""
    eng, hf = _tiny_engine(tiny_hf, page_size=4, num_pages=4)
    out = eng.generate([[5] * 10, [6] * 30], SamplingParams(max_new_tokens=20, ignore_eos=True),
                       progress=False)
    assert out[0].finish_reason == "error" and out[0].num_preemptions == 1
    assert out[0].error == ("request 0 needs 5 KV pages, the cache has 4; raise "
                            "engine.num_pages")
    assert out[0].token_ids == _hf_greedy(hf, [5] * 10, 7)
    assert out[1].finish_reason == "error" and out[1].token_ids == []
    assert out[1].error.startswith("prompt 1: request 1: its prompt needs 8 KV pages but the "
                                   "cache holds only 4")
    assert eng.allocator.num_free == 4  # every page returned


def test_eos_stops_generation(tiny_hf):
    eng, hf = _tiny_engine(tiny_hf)
    prompt = _random_prompts(1, seed=13)[0]
    free_run = _hf_greedy(hf, prompt, 10)
    eng.eos_ids = {free_run[3]}
    out = eng.generate([prompt], SamplingParams(max_new_tokens=10), progress=False)[0]
    first = free_run.index(free_run[3])
    assert out.token_ids == free_run[:first + 1] and out.finish_reason == "stop"


@pytest.mark.slow
def test_smollm2_greedy_equals_hf_generate(smollm2):
    loaded, hf = smollm2
    eng = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(attention="torch"))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    batched = eng.generate(PROMPTS, params, progress=False)
    for prompt, r in zip(PROMPTS, batched):
        assert r.token_ids == _hf_greedy(hf, r.prompt_ids, 12), prompt
    single = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(attention="torch"))
    assert single.generate(PROMPTS[:1], params, progress=False)[0].token_ids == batched[0].token_ids
    assert batched[1].text == loaded.tokenizer.decode(batched[1].token_ids, skip_special_tokens=True)
    assert batched[1].text.strip()
