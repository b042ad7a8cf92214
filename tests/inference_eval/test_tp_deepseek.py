"""DeepSeek (latent attention + mixture of experts with shared experts and a dense first
layer) under tensor parallelism on 2 and 4 gloo ranks (CPU, tiny random HF targets), with
the experts split both ways: TP-MoE (each expert's intermediate dimension) and expert
parallelism (whole experts). Each equals one process: logits within 1e-5 relative (fp32),
greedy generation with continuous batching token for token on 8 prompts of different
lengths, the same fingerprints, one broadcast per step beside 1 + 2L all-reduces and one
gather. A rank reads only its slices of the checkpoint (its experts under EP), in both
expert layouts a checkpoint comes in; bad splits get one line naming the key."""
from __future__ import annotations

import math

import pytest
import torch

from tiny_hf_models import fused_expert_names, hub_expert_names, make_tiny_deepseek
from tp_ranks import (generate_greedy, leader_result, packed_logits, parity_inputs,
                      run_ranks)
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.kv_cache import KVCache
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.model.arch import ModelArch
from inference_eval.engine.parallel.shard import ShardPlan
from inference_eval.engine.parallel.tp import local_parameter_bytes
from inference_eval.engine.target import TargetConfig, load_target

pytestmark = pytest.mark.usefixtures("one_thread")

# Small pages and batches: requests join and leave a running batch (continuous batching).
ENGINE = dict(page_size=4, num_pages=96, max_batch_size=3, max_batched_tokens=64)
# v2_lite: q_proj split by heads (no q low rank), softmax routing, 2 shared experts, YaRN;
# v3: q low rank (replicated q_a), sigmoid + bias group routing, interleaved rope. Both: 4
# heads, 8 routed experts of 24, first layer dense (intermediate 96), 3 layers.
FAMILIES = ("v2_lite", "v3")
MODES = {"tp": False, "ep": True}  # case suffix -> expert_parallel


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """family -> (hf_dir, T=1 logits, T=1 greedy tokens, T=1 identity, layers)."""
    seqs, prompts = parity_inputs()
    out = {}
    for family in FAMILIES:
        d = tmp_path_factory.mktemp(f"tp_{family}")
        make_tiny_deepseek(family, d)
        loaded = load_target(TargetConfig(source="hf", path=str(d)), with_tokenizer=False)
        logits = packed_logits(loaded.model, seqs)
        tokens = generate_greedy(LLMEngine(loaded.model, None, EngineConfig(**ENGINE)), prompts, 8)
        out[family] = (str(d), logits, tokens, loaded.identity, loaded.model.arch.num_layers)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_deepseek_tp_and_ep_match_one_process(world, targets, tmp_path):
    seqs, prompts = parity_inputs()
    assert len({len(p) for p in prompts}) == len(prompts) == 8
    cases = {f"{family}_{mode}": (targets[family][0], ep)
             for family in FAMILIES for mode, ep in MODES.items()}
    got = leader_result(run_ranks("parity_worker", world, cases, seqs, prompts, ENGINE, 8,
                                  tmp=tmp_path, timeout=240))
    for name, res in got.items():
        _, logits, tokens, identity, layers = targets[name.rsplit("_", 1)[0]]
        rel = (res["logits"] - logits).abs().max() / logits.abs().max()
        assert rel < 1e-5, f"{name}: logits differ by {rel:.2e} relative"
        assert res["tokens"] == tokens, name
        for key in ("weights_sha256", "frozen_sha256"):
            assert res["identity"][key] == identity[key], f"{name}: {key}"
        assert res["broadcasts"] > res["steps"], name
        # A prefill and a decode step: each one broadcast, the embedding's all-reduce, one
        # per attention (o_proj) and one per MLP or MoE (routed + shared experts together),
        # one gather of the sampled rows' logits.
        want = {"broadcast": 2, "all_reduce": 2 * (1 + 2 * layers), "gather": 2}
        assert res["collectives_prefill_decode"] == want, name


def _set_expert_layout(path, fused: bool) -> None:
    """Rewrite a checkpoint's routed experts as transformers' fused [E, ...] tensors or as
    the hub's per-expert tensors (DeepSeek's released files)."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    layers = sorted({k.split("mlp.experts.")[0] for k in state if ".mlp.experts." in k})
    for pre in layers:
        part = {k[len(pre):]: state.pop(k) for k in list(state)
                if k.startswith(pre + "mlp.experts.")}
        if fused != ("mlp.experts.gate_up_proj" in part):
            part = fused_expert_names(part) if fused else hub_expert_names(part)
        state.update({pre + k: v.contiguous().clone() for k, v in part.items()})
    save_file(state, str(path), metadata={"format": "pt"})


REPLICATED = ("norm.weight", "mlp.gate.weight", "e_score_correction_bias")  # read whole
LATENT = ("kv_a_proj_with_mqa.weight",)  # rows of a split parameter that every rank holds


@pytest.mark.parametrize("fused,expert_parallel", [(False, True), (True, False)],
                         ids=["hub_experts_ep", "fused_experts_tp"])
def test_rank_reads_only_its_slices(fused, expert_parallel, tmp_path):
    hf_dir = tmp_path / "v2_lite"
    make_tiny_deepseek("v2_lite", hf_dir)
    _set_expert_layout(hf_dir / "model.safetensors", fused)
    full = load_target(TargetConfig(source="hf", path=str(hf_dir)), with_tokenizer=False)
    total = local_parameter_bytes(full.model)
    results = run_ranks("memory_worker", 2, str(hf_dir), expert_parallel, tmp=tmp_path,
                        timeout=120)
    leader_result(results)
    from safetensors import safe_open

    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        shapes = {n: f.get_slice(n).get_shape() for n in f.keys()}
    arch, params = full.model.arch, dict(full.model.named_parameters())
    per_rank = arch.n_routed_experts // 2
    for rank, res in enumerate(r["ok"] for r in results):
        assert res["param_bytes"] <= 0.56 * total, (rank, res["param_bytes"], total)
        assert res["identity"]["weights_sha256"] == full.identity["weights_sha256"]
        specs = ShardPlan(arch, 2, rank, expert_parallel).specs()
        for n, p in res["params"].items():  # the slices read are the full model's slices
            assert torch.equal(p, specs[n].take(params[n])), (rank, n)
        reads = res["reads"]
        assert all(n.endswith(REPLICATED) for n in reads["full"]), sorted(reads["full"])
        # Under EP a rank never touches another rank's expert tensors (hub layout).
        others = {n for n in shapes if expert_parallel and _expert(n) is not None
                  and _expert(n) // per_rank != rank}
        split = {n for n in shapes if not n.endswith(REPLICATED)}
        assert set(reads["slices"]) == split - others, (rank, split - others, reads["slices"])
        for name, counts in reads["slices"].items():
            whole = math.prod(shapes[name])
            if name.endswith(LATENT) or (expert_parallel and _expert(name) is not None):
                assert sum(counts) == whole, (rank, name)  # the latent, or one of its experts
            else:
                assert sum(counts) <= whole // 2, (rank, name, counts, whole)


def _expert(name: str) -> int | None:
    """The routed expert of a hub-layout tensor name (model.layers.i.mlp.experts.e.*)."""
    parts = name.split(".")
    at = parts.index("experts") + 1 if "experts" in parts else len(parts)
    return int(parts[at]) if at < len(parts) and parts[at].isdigit() else None


def _arch(**kw) -> ModelArch:
    base = dict(architecture="DeepseekV2ForCausalLM", vocab_size=320, hidden_size=64,
                intermediate_size=96, num_layers=3, num_heads=4, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=24, n_shared_experts=2,
                first_k_dense_replace=1)
    return ModelArch(**{**base, **kw})


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_drawn_target_keeps_its_slices(expert_parallel):
    # Random targets (the tiny_deepseek preset) are drawn whole, then sliced in place.
    from inference_eval.engine.model.transformer import TransformerLM
    from inference_eval.engine.parallel.group import TPGroup
    from inference_eval.engine.parallel.tp import parallelize

    arch = _arch(architecture="DeepseekV3ForCausalLM", q_lora_rank=16, scoring_func="sigmoid",
                 topk_method="noaux_tc", n_group=4, topk_group=2, n_shared_experts=1)
    torch.manual_seed(0)
    model = TransformerLM(arch)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    tp = TPGroup(1, 2, None, 0, 0, 1, torch.device("cpu"))  # rank 1 of 2; no collective runs
    specs = parallelize(model, tp, expert_parallel).specs()
    got = dict(model.named_parameters())
    assert set(got) == set(full) == set(specs)
    for n, p in got.items():
        assert torch.equal(p, specs[n].take(full[n])), n


def test_latent_cache_geometry_is_the_leaders_on_every_rank():
    # Every rank caches the whole latent row: per-token bytes do not shrink with T.
    arch = _arch()
    for t in (2, 4):
        local = ShardPlan(arch, t, t - 1).local_arch()
        assert (local.num_heads, local.num_kv_heads, local.head_dim) == (4 // t, 1, 40)
        assert (KVCache.bytes_per_token_for_arch(local, torch.bfloat16)
                == KVCache.bytes_per_token_for_arch(arch, torch.bfloat16) == 3 * 40 * 2)


def test_expert_ranges_per_rank():
    arch = _arch()
    assert [ShardPlan(arch, 4, r, True).expert_start for r in range(4)] == [0, 2, 4, 6]
    ep, tp = ShardPlan(arch, 4, 1, True), ShardPlan(arch, 4, 1)
    assert (ep.experts, ep.moe_inter, ep.shared_inter) == (2, 24, 12)
    assert (tp.experts, tp.moe_inter, tp.shared_inter) == (8, 6, 12)


@pytest.mark.parametrize("kw,size,ep,message", [
    (dict(num_heads=6), 4, False, "engine.tensor_parallel=4 does not divide the target's "
                                  "num_heads=6"),
    (dict(num_heads=6), 3, True, "engine.expert_parallel=true: engine.tensor_parallel=3 does "
                                 "not divide the target's n_routed_experts=8"),
    (dict(moe_intermediate_size=26), 4, False, "engine.tensor_parallel=4 does not divide the "
                                               "target's moe_intermediate_size=26"),
    (dict(intermediate_size=98), 4, True, "engine.tensor_parallel=4 does not divide the "
                                          "target's intermediate_size=98"),
    (dict(n_routed_experts=0, num_experts_per_tok=0), 2, True,
     "engine.expert_parallel=true needs a target with routed experts"),
])
def test_unsplittable_deepseek_is_refused_by_name(kw, size, ep, message):
    with pytest.raises(ValueError, match=message):
        ShardPlan(_arch(**kw), size, 0, ep)


def test_expert_parallel_needs_tensor_parallel():
    with pytest.raises(ValueError, match=r"engine.expert_parallel=true .* needs "
                                         r"engine.tensor_parallel > 1, got 1"):
        EngineConfig(expert_parallel=True)
    assert EngineConfig(tensor_parallel=2, expert_parallel=True).expert_parallel
