"""DeepSeek targets through LLMEngine: greedy output equal to transformers' generate, the
batched paged path equal to a per-request loop, the tiny random preset, FlashInfer refusal."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from tiny_hf_models import make_tiny_deepseek
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.kv_cache import KVCache
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.target import TargetConfig, load_target

CONF = Path(__file__).resolve().parents[2] / "conf" / "target"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_v3")
    hf = make_tiny_deepseek("v3", d)
    return d, hf


def _engine(hf_dir, **cfg) -> LLMEngine:
    model = load_target(TargetConfig(source="hf", path=str(hf_dir)), with_tokenizer=False).model
    return LLMEngine(model, None, EngineConfig(attention="torch", **cfg))


def _prompts(k: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (int(torch.randint(2, 30, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(k)]


def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None  # like ignore_eos
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_greedy_equals_hf_generate(v3):
    hf_dir, hf = v3
    eng = _engine(hf_dir, page_size=4)
    prompts = _prompts(4, seed=3)
    out = eng.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True), progress=False)
    for p, r in zip(prompts, out):
        assert r.token_ids == _hf_greedy(hf, p, 10)


def test_batched_paged_path_equals_per_request_loop(v3):
    hf_dir, _ = v3
    prompts = _prompts(5, seed=5)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    batched = [r.token_ids for r in _engine(hf_dir, page_size=4, max_batched_tokens=48)
               .generate(prompts, params, progress=False)]
    alone = [_engine(hf_dir, page_size=4).generate([p], params, progress=False)[0].token_ids
             for p in prompts]
    assert batched == alone


def test_engine_allocates_only_the_latent_cache(v3):
    eng = _engine(v3[0], page_size=4, num_pages=8)
    a = eng.model.arch
    assert eng.cache.nbytes() == 8 * 4 * KVCache.bytes_per_token_for_arch(a, torch.float32)


def test_tiny_deepseek_preset_generates():
    """conf/target/tiny_deepseek.yaml: random weights (every MoE/MLA tensor initialised)."""
    spec = yaml.safe_load((CONF / "tiny_deepseek.yaml").read_text())
    spec.pop("tokenizer", None)  # text is not under test here
    loaded = load_target(TargetConfig(**spec), with_tokenizer=False)
    assert loaded.model.arch.is_mla and loaded.model.arch.n_routed_experts > 0
    assert all(torch.isfinite(p).all() for p in loaded.model.parameters())
    eng = LLMEngine(loaded.model, None, EngineConfig(attention="torch", page_size=4, num_pages=32))
    out = eng.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(max_new_tokens=4, ignore_eos=True),
                       progress=False)
    assert [len(r.token_ids) for r in out] == [4, 4]


def test_flashinfer_mla_refuses_a_cacheless_pass_naming_the_fix(v3):
    """FlashInfer's MLA kernel reads a paged latent cache; a cacheless (packed) pass is
    refused by name (the GPU paths themselves: test_flashinfer_mla.py)."""
    from inference_eval.engine.attention.flashinfer_backend import FlashInferPlan

    plan = object.__new__(FlashInferPlan)  # no CUDA needed: the refusal precedes any kernel
    q, lat = torch.zeros(2, 4, 40), torch.zeros(2, 1, 40)
    with pytest.raises(NotImplementedError, match="FlashInfer MLA"):
        plan.attend_latent(0, q, lat, None, 32, 0.1)
