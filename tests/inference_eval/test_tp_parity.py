"""Tensor parallelism on 2 and 4 gloo ranks (CPU, tiny random HF targets) equals one process:
logits within 1e-5 relative (fp32; only the order of the all-reduced sums differs), greedy
generation with continuous batching token for token, the same target fingerprints, one
broadcast per step beside the model's collectives."""
from __future__ import annotations

import pytest
import torch

from tiny_hf_models import make_tiny_hf
from tp_ranks import (generate_greedy, leader_result, packed_logits, parity_inputs,
                      run_ranks)
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.target import TargetConfig, load_target

# Small pages and batches: requests join and leave a running batch (continuous batching).
ENGINE = dict(page_size=4, num_pages=96, max_batch_size=3, max_batched_tokens=64)
# name -> (family, HF config overrides), per world size. The tiny default: 6 heads, 2 KV heads.
CASES = {
    2: {"llama_kv_split": ("llama3", {}),  # 2 KV heads, one per rank
        "llama_kv_replicated": ("llama3", {"num_key_value_heads": 1}),  # 1 KV head on both
        "qwen2_bias": ("qwen2", {}),  # qkv bias, tied embeddings
        "qwen3_qk_norm": ("qwen3", {})},
    4: {"llama_kv_split": ("llama3", {"num_attention_heads": 8, "num_key_value_heads": 4}),
        "llama_kv_replicated": ("llama3", {"num_attention_heads": 8}),  # 2 KV heads, 4 ranks
        # vocabulary 322: ranks hold 81 rows, the last one padded
        "qwen2_bias": ("qwen2", {"num_attention_heads": 8, "vocab_size": 322}),
        "qwen3_qk_norm": ("qwen3", {"num_attention_heads": 8})},
}


def _reference(hf_dir: str, seqs, prompts, max_new: int):
    loaded = load_target(TargetConfig(source="hf", path=hf_dir), with_tokenizer=False)
    logits = packed_logits(loaded.model, seqs)
    engine = LLMEngine(loaded.model, None, EngineConfig(**ENGINE))
    return loaded, logits, generate_greedy(engine, prompts, max_new)


@pytest.mark.parametrize("world", [2, 4])
def test_tp_matches_one_process(world, tmp_path):
    seqs, prompts = parity_inputs()
    dirs = {}
    for name, (family, overrides) in CASES[world].items():
        d = tmp_path / name
        make_tiny_hf(family, d, **overrides)
        dirs[name] = str(d)
    got = leader_result(run_ranks("parity_worker", world, dirs, seqs, prompts, ENGINE, 8,
                                  tmp=tmp_path, timeout=240))
    for name, hf_dir in dirs.items():
        loaded, logits, tokens = _reference(hf_dir, seqs, prompts, 8)
        res = got[name]
        rel = (res["logits"] - logits).abs().max() / logits.abs().max()
        assert rel < 1e-5, f"{name}: logits differ by {rel:.2e} relative"
        assert res["tokens"] == tokens, name
        assert res["broadcasts"] > res["steps"], name  # one per step, plus the buffer's growth
        assert len({len(t) for t in prompts}) == len(prompts)
        for key in ("weights_sha256", "frozen_sha256"):
            assert res["identity"][key] == loaded.identity[key], f"{name}: {key}"
        layers = loaded.model.arch.num_layers
        # Two steps (a prefill, a decode): each one broadcast, and the model's embedding
        # all-reduce, two per layer, one gather of the sampled rows' logits.
        want = {"broadcast": 2, "all_reduce": 2 * (1 + 2 * layers), "gather": 2}
        assert res["collectives_prefill_decode"] == want, name
