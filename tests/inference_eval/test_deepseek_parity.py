"""DeepSeek-V2/V3 (MLA + MoE) against transformers on tiny random configs (fp32, 1e-4):
packed logits, paged prefill + decode, a mixed batch against a per-request loop, and the
latent KV cache size."""
from __future__ import annotations

import pytest
import torch

from tiny_hf_models import DEEPSEEK_FAMILIES, make_tiny_deepseek
from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionBackend
from inference_eval.engine.kv_cache import KVCache
from inference_eval.engine.model.arch import ModelArch
from inference_eval.engine.target import TargetConfig, load_target


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    """family -> (hf_dir, hf_model, our model loaded from hf_dir), built once per module."""
    cache = {}

    def get(family: str):
        if family not in cache:
            d = tmp_path_factory.mktemp(f"tiny_{family}")
            hf = make_tiny_deepseek(family, d)
            ours = load_target(TargetConfig(source="hf", path=str(d)), with_tokenizer=False).model
            cache[family] = (d, hf, ours)
        return cache[family]

    return get


def test_families_cover_the_required_variants(tiny_deepseek):
    archs = {f: tiny_deepseek(f)[2].arch for f in DEEPSEEK_FAMILIES}
    assert {a.architecture for a in archs.values()} == {"DeepseekV2ForCausalLM",
                                                        "DeepseekV3ForCausalLM"}
    assert {a.q_lora_rank is None for a in archs.values()} == {True, False}
    assert {a.topk_method for a in archs.values()} == {"greedy", "group_limited_greedy", "noaux_tc"}
    assert {a.rope_interleave for a in archs.values()} == {True, False}
    assert any((a.rope_scaling or {}).get("rope_type") == "yarn" for a in archs.values())
    assert all(a.n_shared_experts > 0 for a in archs.values())
    assert any(a.first_k_dense_replace > 0 for a in archs.values())
    a = archs["v2_lite"]
    assert [a.is_moe_layer(i) for i in range(a.num_layers)] == [False, True, True]


@pytest.mark.parametrize("family", sorted(DEEPSEEK_FAMILIES))
def test_packed_logits_match_hf(family, tiny_deepseek):
    _, hf, ours = tiny_deepseek(family)
    g = torch.Generator().manual_seed(1)
    # 90 > original_max_position_embeddings (32): YaRN's interpolated band is exercised.
    seqs = [torch.randint(0, 320, (n,), generator=g) for n in (90, 37, 5)]
    with torch.no_grad():
        out = ours(torch.cat(seqs), TorchAttentionBackend().plan(BatchLayout.packed([90, 37, 5])))
        start = 0
        for s in seqs:
            ref = hf(s[None]).logits[0]
            torch.testing.assert_close(out.logits[start:start + len(s)], ref, atol=1e-4, rtol=1e-4)
            start += len(s)


@pytest.mark.parametrize("family", ["v2_lite", "v3"])
def test_paged_prefill_then_decode_matches_hf(family, tiny_deepseek):
    _, hf, model = tiny_deepseek(family)
    a = model.arch
    cache = KVCache.for_arch(a, 16, 8)
    be = TorchAttentionBackend()
    ids = torch.randint(0, 320, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
        pages = [5, 2, 9, 0, 11]  # deliberately out of order
        pre = model(ids[:30], be.plan(BatchLayout([30], [30], [pages], 8)), cache)
        torch.testing.assert_close(pre.logits, ref[:30], atol=1e-4, rtol=1e-4)
        for t in range(30, 40):
            step = model(ids[t:t + 1], be.plan(BatchLayout([1], [t + 1], [pages], 8)), cache)
            torch.testing.assert_close(step.logits[0], ref[t], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["v2_group", "v3"])
def test_mixed_paged_batch_equals_per_request_loop(family, tiny_deepseek):
    """One step holding a decode (A), a fresh prompt (B) and a chunk on top of a cache (C)
    gives each request the logits it gets alone."""
    _, _, model = tiny_deepseek(family)
    a, be, ps = model.arch, TorchAttentionBackend(), 4
    g = torch.Generator().manual_seed(3)
    ctx_lens, new_lens = [11, 0, 6], [1, 7, 3]
    tables = [[3, 0, 7], [1, 8], [4, 2, 6]]
    toks = [torch.randint(0, 320, (c + n,), generator=g) for c, n in zip(ctx_lens, new_lens)]

    def prefill(cache, b):
        if ctx_lens[b]:
            model(toks[b][:ctx_lens[b]], be.plan(BatchLayout([ctx_lens[b]], [ctx_lens[b]],
                                                             [tables[b]], ps)), cache)

    with torch.no_grad():
        alone = []
        for b in range(3):
            cache = KVCache.for_arch(a, 10, ps)
            prefill(cache, b)
            lay = BatchLayout([new_lens[b]], [ctx_lens[b] + new_lens[b]], [tables[b]], ps)
            alone.append(model(toks[b][ctx_lens[b]:], be.plan(lay), cache).logits)
        cache = KVCache.for_arch(a, 10, ps)
        for b in range(3):
            prefill(cache, b)
        lay = BatchLayout(new_lens, [c + n for c, n in zip(ctx_lens, new_lens)], tables, ps)
        ids = torch.cat([t[c:] for t, c in zip(toks, ctx_lens)])
        together = model(ids, be.plan(lay), cache).logits
    torch.testing.assert_close(together, torch.cat(alone), atol=1e-5, rtol=1e-5)


def test_latent_kv_cache_bytes_per_token(tiny_deepseek):
    """The cache holds kv_lora_rank + qk_rope_head_dim numbers per token and layer, nothing
    else: 3 layers x (32 + 8) x 4 bytes = 480 (a Llama cache of the same 4 heads of 24
    would hold 2 x 3 x 4 x 24 x 4 = 2304)."""
    a = tiny_deepseek("v2_lite")[2].arch
    latent = a.num_layers * (a.kv_lora_rank + a.qk_rope_head_dim)
    assert latent == 3 * (32 + 8)
    for dtype in (torch.float32, torch.bfloat16):
        size = torch.empty((), dtype=dtype).element_size()
        assert KVCache.bytes_per_token_for_arch(a, dtype) == latent * size
        cache = KVCache.for_arch(a, num_pages=6, page_size=4, dtype=dtype)
        assert cache.is_latent and cache.nbytes() == 6 * 4 * latent * size
    llama = ModelArch()
    assert KVCache.bytes_per_token_for_arch(llama, torch.float32) == KVCache.bytes_per_token(
        llama.num_layers, llama.num_kv_heads, llama.head_dim, torch.float32)
    assert not KVCache.for_arch(llama, 2, 4).is_latent


def test_in_memory_state_dict_with_fused_experts_loads(tiny_deepseek):
    """transformers' in-memory names (experts fused [E, 2I, H]) go through the same adapter
    as the per-expert files save_pretrained writes."""
    from inference_eval.engine.model.transformer import TransformerLM
    from inference_eval.engine.model.weights import load_hf_tensors

    _, hf, ours = tiny_deepseek("v3")
    sd = hf.state_dict()
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd
    fresh = TransformerLM(ours.arch)
    load_hf_tensors(fresh, ours.arch, ((k, lambda v=v: v) for k, v in sd.items()), "hf.state_dict()")
    for (name, a), b in zip(fresh.state_dict().items(), ours.state_dict().values()):
        assert torch.equal(a, b), name
