"""A DeepSeek-V3 checkpoint's native MTP layer (model.layers.{L}.*) as the draft: its logits
in the engine equal a plain reference computation of the module, greedy speculative output
equals autoregressive output, our trained mtp head exported to `deepseek_mtp` reads back with
identical logits (and loads into transformers' DeepSeek layer), and a checkpoint without the
MTP tensors is refused naming the tensor and the fix."""
from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_hf_models import add_native_mtp_layer, make_tiny_deepseek
from heads.checkpoint import load_head, save_head
from heads.config import HeadConfig
from heads.registry import build_head
from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionBackend
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.speculative.drafters import HeadDrafter
from inference_eval.engine.target import TargetConfig, load_target
from inference_eval.evaluation.engines import build_engine, frozen_parts_of
from train.export.__main__ import main as export_cli

CFG = dict(attention="torch", page_size=4)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A tiny DeepSeek-V3 (interleaved rope, YaRN, MoE layers 1-2) without an MTP layer."""
    d = tmp_path_factory.mktemp("v3_plain")
    hf = make_tiny_deepseek("v3", d)
    return d, hf, load_target(TargetConfig(name="v3", source="hf", path=str(d)),
                              with_tokenizer=False)


@pytest.fixture(scope="module")
def native(plain, tmp_path_factory):
    """The same model as a V3-style checkpoint with a random native MTP layer at index 3."""
    d = tmp_path_factory.mktemp("v3_mtp") / "ck"
    shutil.copytree(plain[0], d)
    parts = add_native_mtp_layer(d, plain[1])
    return d, parts


def _ids(n: int = 23, seed: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.tensor([1]), torch.randint(3, 320, (n - 1,), generator=g)])


def _target_hidden(loaded, ids: torch.Tensor) -> torch.Tensor:
    """The target's last-layer states h [T, H] (pre-norm) through the engine."""
    with torch.no_grad():
        plan = TorchAttentionBackend().plan(BatchLayout.packed([len(ids)]))
        return loaded.model(ids, plan, None, compute_logits=False).hidden


def engine_step1_logits(head, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The head in the engine's paged path (HeadDrafter, latent KV pages of 4): entry j reads
    (h_j, tokens_j) -> logits [T, V] of step 1."""
    n, ps = len(tokens), 4
    pages = -(-n // ps)
    d = HeadDrafter(head, pages, ps, "cpu", torch.float32)
    d.bind(TorchAttentionBackend(), False)
    plan = d.backend.plan(BatchLayout([n], [n], [list(range(pages))], ps))
    with torch.no_grad():
        return d.run(tokens, head.first_hidden(hidden, None), plan)[1]


def reference_logits(hf, parts, ids: torch.Tensor, normed_hidden: bool = True) -> torch.Tensor:
    """The MTP module in plain torch + transformers' DeepseekV3DecoderLayer: entry t reads
    hnorm(h_t) and enorm(E[x_{t+1}]), h_t the target's post-norm state (pre-norm when
    normed_hidden is False) -> logits [n-1, V] of x_{t+2}."""
    with torch.no_grad():
        h = hf.model(ids[None]).last_hidden_state[0] if normed_hidden else _prenorm(hf, ids)
        e = parts["enorm"](hf.model.embed_tokens(ids[1:]))
        z = parts["eh_proj"](torch.cat([e, parts["hnorm"](h[:-1])], dim=-1))[None]
        pos = torch.arange(len(ids) - 1)[None]
        o = parts["layer"](z, attention_mask=None, position_ids=pos,
                           position_embeddings=hf.model.rotary_emb(z, pos))
        o = o[0] if isinstance(o, tuple) else o
        return hf.lm_head(parts["shared_norm"](o[0]))


def _prenorm(hf, ids):
    """Output of the last decoder layer before the final norm (a forward hook)."""
    got = {}
    hook = hf.model.layers[-1].register_forward_hook(
        lambda m, i, o: got.setdefault("h", o[0] if isinstance(o, tuple) else o))
    hf.model(ids[None])
    hook.remove()
    return got["h"][0]


def test_native_mtp_layer_drafts_with_the_modules_own_logits(plain, native):
    _, hf, loaded = plain
    d, parts = native
    # The main model of a checkpoint with layer 3 = MTP still loads as 3 layers (layer 3 skipped).
    again = load_target(TargetConfig(name="v3", source="hf", path=str(d)), with_tokenizer=False)
    assert len(again.model.layers) == 3
    head = load_head(d, frozen_parts_of(loaded))
    assert head.cfg.type == "mtp" and head.cfg.hidden_input == "post_norm"
    assert type(head.layer.self_attn).__name__ == "MLAttention"
    assert type(head.layer.mlp).__name__ == "MLP"
    ids = _ids()
    got = engine_step1_logits(head, ids[1:], _target_hidden(loaded, ids)[:-1])
    want = reference_logits(hf, parts, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scheme", ["chain", "tree"])
def test_native_mtp_greedy_equals_autoregressive(plain, native, scheme):
    loaded = plain[2]
    g = torch.Generator().manual_seed(8)
    prompts = [[1] + torch.randint(3, 320, (int(torch.randint(3, 20, (1,), generator=g)),),
                                   generator=g).tolist() for _ in range(4)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ar = LLMEngine(loaded.model, None, EngineConfig(**CFG)).generate(prompts, params, progress=False)
    draft = SimpleNamespace(kind="head", checkpoint=str(native[0]), scheme=scheme, num_draft=3,
                            sync_free=False, depth=3, topk=3, total_tokens=10)
    eng = build_engine(loaded, EngineConfig(**CFG), draft)
    out = eng.generate(prompts, params, progress=False)
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    assert sum(sum(r.meta["proposed"]) for r in out) > 0


def test_export_to_deepseek_mtp_reads_back_with_identical_logits(plain, tmp_path):
    d, hf, loaded = plain
    parts = frozen_parts_of(loaded)
    head = build_head(HeadConfig(type="mtp"), parts, seed=3)
    save_head(head, tmp_path / "ours")
    out = tmp_path / "mtp"
    assert export_cli(["--checkpoint", str(tmp_path / "ours"), "--format", "deepseek_mtp",
                       "--output", str(out), "--target-dir", str(d)]) == 0  # python -m train.export
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    assert cfg["specheads_mtp"]["hidden_input"] == "pre-final-norm"
    mtp = load_file(str(out / "model-mtp.safetensors"))
    assert {"model.layers.3.eh_proj.weight", "model.layers.3.shared_head.head.weight",
            "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
            "model.layers.3.self_attn.q_a_proj.weight", "model.layers.3.mlp.gate_proj.weight",
            "model.layers.3.embed_tokens.weight"} <= set(mtp)
    back = load_head(out, parts)
    assert back.cfg.hidden_input == "pre_norm"
    ids = _ids(seed=6)
    hidden = _target_hidden(loaded, ids)[:-1]
    assert torch.equal(engine_step1_logits(head, ids[1:], hidden),
                       engine_step1_logits(back, ids[1:], hidden))
    # What a DeepSeek loader reads: the layer-3 tensors load strictly into transformers' own
    # DeepSeek-V3 decoder layer (rotary rows back in interleaved order), and that module
    # computes our head's logits.
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3DecoderLayer,
                                                                      DeepseekV3RMSNorm)

    c, h, pre = hf.config, hf.config.hidden_size, "model.layers.3."
    eps = c.rms_norm_eps
    ref = {"enorm": DeepseekV3RMSNorm(h, eps), "hnorm": DeepseekV3RMSNorm(h, eps),
           "eh_proj": torch.nn.Linear(2 * h, h, bias=False),
           "layer": DeepseekV3DecoderLayer(c, layer_idx=0), "shared_norm": DeepseekV3RMSNorm(h, eps)}
    for key, leaf in (("enorm", "enorm."), ("hnorm", "hnorm."), ("eh_proj", "eh_proj."),
                      ("shared_norm", "shared_head.norm."), ("layer", "")):
        own = {k[len(pre + leaf):]: v for k, v in mtp.items() if k.startswith(pre + leaf)}
        if key == "layer":
            own = {k: v for k, v in own.items() if k.split(".")[0] in
                   ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")}
        ref[key].load_state_dict(own, strict=True)
        ref[key].eval()
    want = reference_logits(hf, ref, ids, normed_hidden=False)
    torch.testing.assert_close(engine_step1_logits(back, ids[1:], hidden), want,
                               atol=1e-4, rtol=1e-4)


def _copy_without(src, dst, tensor: str):
    """A copy of checkpoint `src` at `dst` whose model.safetensors lacks `tensor`."""
    shutil.copytree(src, dst)
    w = load_file(str(dst / "model.safetensors"))
    del w[tensor]
    save_file(w, str(dst / "model.safetensors"))
    return dst


def _as_draft(ck):
    return SimpleNamespace(kind="head", checkpoint=str(ck), scheme="chain", num_draft=3,
                           sync_free=False)


def test_deepseek_checkpoint_without_mtp_tensors_is_refused_with_the_fix(plain, native, tmp_path):
    d, _, loaded = plain
    fix = r".*train\.export --format deepseek_mtp"
    # transformers' save_pretrained writes num_nextn_predict_layers=1 but drops layer 3.
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers=1, but the MTP layer's "
                                         r"tensor\(s\) \['model\.layers\.3\.enorm\.weight'" + fix):
        build_engine(loaded, EngineConfig(**CFG), _as_draft(d))
    # A DeepSeek checkpoint that declares no MTP layer.
    none = tmp_path / "none"
    shutil.copytree(d, none)
    cfg = json.loads((none / "config.json").read_text())
    (none / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers=0.*model\.layers\.3\.\*" + fix):
        build_engine(loaded, EngineConfig(**CFG), _as_draft(none))
    # One decoder-layer tensor of the MTP layer missing: named by its checkpoint name.
    partial = _copy_without(native[0], tmp_path / "partial",
                            "model.layers.3.self_attn.kv_b_proj.weight")
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['model\.layers\.3\.self_attn"
                                         r"\.kv_b_proj\.weight'\]"):
        build_engine(loaded, EngineConfig(**CFG), _as_draft(partial))


# ---- an MoE MTP layer: DeepSeek-V3/R1's real layer 61 routes experts ----------------------

@pytest.fixture(scope="module")
def native_moe(plain, tmp_path_factory):
    """The V3 model with a random native MTP layer that is an MoE layer (sigmoid + bias
    routing over 4 groups, a shared expert), its experts under the hub's per-expert names."""
    d = tmp_path_factory.mktemp("v3_mtp_moe") / "ck"
    shutil.copytree(plain[0], d)
    parts = add_native_mtp_layer(d, plain[1], seed=2, moe=True)
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in load_file(str(d / "model.safetensors"))
    return d, parts


def test_native_moe_mtp_layer_drafts_with_the_modules_own_logits(plain, native_moe):
    _, hf, loaded = plain
    d, parts = native_moe
    head = load_head(d, frozen_parts_of(loaded))
    assert head.cfg.moe and type(head.layer.mlp).__name__ == "MoE"
    ids = _ids(seed=9)
    got = engine_step1_logits(head, ids[1:], _target_hidden(loaded, ids)[:-1])
    torch.testing.assert_close(got, reference_logits(hf, parts, ids), atol=1e-4, rtol=1e-4)


def test_native_moe_mtp_greedy_chain_equals_autoregressive(plain, native_moe):
    loaded = plain[2]
    g = torch.Generator().manual_seed(3)
    prompts = [[1] + torch.randint(3, 320, (9 + 3 * i,), generator=g).tolist() for i in range(3)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    ar = LLMEngine(loaded.model, None, EngineConfig(**CFG)).generate(prompts, params, progress=False)
    out = build_engine(loaded, EngineConfig(**CFG), _as_draft(native_moe[0])).generate(
        prompts, params, progress=False)
    assert [r.token_ids for r in out] == [r.token_ids for r in ar]
    assert sum(sum(r.meta["proposed"]) for r in out) > 0


def test_moe_head_exports_to_deepseek_mtp_and_loads_into_transformers_moe_layer(plain, tmp_path):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    from tiny_hf_models import fused_expert_names

    d, hf, loaded = plain
    parts = frozen_parts_of(loaded)
    head = build_head(HeadConfig(type="mtp", moe=True), parts, seed=4)
    save_head(head, tmp_path / "ours")
    out = tmp_path / "mtp"
    assert export_cli(["--checkpoint", str(tmp_path / "ours"), "--format", "deepseek_mtp",
                       "--output", str(out), "--target-dir", str(d)]) == 0
    mtp = load_file(str(out / "model-mtp.safetensors"))
    pre = "model.layers.3."
    assert {pre + "mlp.experts.0.gate_proj.weight", pre + "mlp.experts.7.down_proj.weight",
            pre + "mlp.gate.weight", pre + "mlp.gate.e_score_correction_bias",
            pre + "mlp.shared_experts.up_proj.weight"} <= set(mtp)
    assert pre + "mlp.gate_proj.weight" not in mtp
    back = load_head(out, parts)
    assert back.cfg.moe
    ids = _ids(seed=10)
    hidden = _target_hidden(loaded, ids)[:-1]
    assert torch.equal(engine_step1_logits(head, ids[1:], hidden),
                       engine_step1_logits(back, ids[1:], hidden))
    # transformers' own MoE layer (layer_idx 3 is an MoE layer by the config) loads it strictly.
    layer = DeepseekV3DecoderLayer(hf.config, layer_idx=3)
    own = {k[len(pre):]: v for k, v in mtp.items() if k.startswith(pre) and k[len(pre):].split(
        ".")[0] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")}
    layer.load_state_dict(fused_expert_names(own), strict=True)


def test_moe_mtp_layer_with_a_missing_expert_is_refused_naming_it(plain, native_moe, tmp_path):
    bad = _copy_without(native_moe[0], tmp_path / "bad",
                        "model.layers.3.mlp.experts.5.up_proj.weight")
    with pytest.raises(ValueError, match=r"missing tensor\(s\) \['model\.layers\.3\.mlp\.experts"
                                         r"\.5\.up_proj\.weight'\]"):
        build_engine(plain[2], EngineConfig(**CFG), _as_draft(bad))
