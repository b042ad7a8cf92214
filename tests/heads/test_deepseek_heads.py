"""Heads on a DeepSeek target: the head's one layer is the target's latent attention (MLA)
with a dense MLP, or with `head.moe` the target's mixture of experts (DeepSeek-V3's own MTP
layer is one), and its training rollout (heads/rollout_attention.py, latent q/k/v) gives
the draft logits the engine's paged path (HeadDrafter over a latent KV cache) gives, step by
step of a K = 3 chain, on a packed batch of two sequences."""
from __future__ import annotations

import pytest
import torch

from tiny_hf_models import make_tiny_deepseek
from heads.batch import PackedBatch
from heads.config import HeadConfig
from heads.registry import build_head
from heads.rollout import rollout
from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionBackend
from inference_eval.engine.model.mla import MLAttention
from inference_eval.engine.model.mlp import MLP
from inference_eval.engine.model.moe import MoE
from inference_eval.engine.speculative.drafters import HeadDrafter
from inference_eval.engine.target import TargetConfig, load_target
from inference_eval.evaluation.engines import frozen_parts_of


@pytest.fixture(scope="module", params=["v3", "v3_half", "v2_lite"])
def loaded(request, tmp_path_factory):
    """v3: interleaved rope + YaRN, layer 0 dense; v3_half: layer 0 of the target is MoE;
    v2_lite: no q low rank, YaRN with mscale != mscale_all_dim."""
    d = tmp_path_factory.mktemp(request.param)
    make_tiny_deepseek(request.param, d)
    return load_target(TargetConfig(name=request.param, source="hf", path=str(d)),
                       with_tokenizer=False)


@pytest.mark.parametrize("kind", ["mtp", "eagle1", "eagle3"])
def test_head_layer_is_mla_with_a_dense_mlp(loaded, kind):
    aux = [0, 1, 2] if kind == "eagle3" else []
    head = build_head(HeadConfig(type=kind, aux_layers=aux), frozen_parts_of(loaded), seed=0)
    assert isinstance(head.layer.self_attn, MLAttention)
    assert isinstance(head.layer.mlp, MLP)
    assert head.layer.mlp.inter == loaded.model.arch.intermediate_size
    assert head.rope_cos.shape[1] == loaded.model.arch.qk_rope_head_dim


def test_moe_head_layer_has_the_targets_experts_and_trains_them(loaded):
    a = loaded.model.arch
    head = build_head(HeadConfig(type="mtp", moe=True), frozen_parts_of(loaded), seed=0)
    moe = head.layer.mlp
    assert isinstance(moe, MoE) and isinstance(head.layer.self_attn, MLAttention)
    assert moe.experts.gate_up_proj.shape == (a.n_routed_experts, 2 * a.moe_intermediate_size,
                                              a.hidden_size)
    assert (moe.shared_experts is not None) == (a.n_shared_experts > 0)
    assert head.arch.scoring_func == a.scoring_func and head.arch.n_group == a.n_group
    # The objective's gradient reaches the routed experts and the router.
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 320, (12,), generator=g)
    with torch.no_grad():
        hidden = loaded.model(ids, TorchAttentionBackend().plan(BatchLayout.packed([12])), None,
                              compute_logits=False).hidden
    loss, _ = head(PackedBatch(ids, hidden, torch.ones(12, dtype=torch.bool), [12]))
    loss.backward()
    assert moe.experts.gate_up_proj.grad.abs().sum() > 0 and moe.gate.weight.grad.abs().sum() > 0


def test_moe_head_needs_an_moe_target_and_an_mtp_head():
    from inference_eval.engine.model.arch import ModelArch
    from heads.base import head_arch

    with pytest.raises(ValueError, match=r"no routed experts.*head\.moe=false"):
        head_arch(ModelArch(), moe=True)
    with pytest.raises(ValueError, match=r"head\.moe=true applies to mtp heads only"):
        HeadConfig(type="eagle1", moe=True)


@pytest.mark.parametrize("moe", [False, True])
def test_rollout_logits_equal_the_engines_paged_draft_logits(loaded, moe):
    torch.set_num_threads(1)
    head = build_head(HeadConfig(type="mtp", num_steps=3, moe=moe), frozen_parts_of(loaded),
                      seed=1)
    head.eval()
    g = torch.Generator().manual_seed(2)
    lens = [9, 14]
    ids = torch.randint(3, 320, (sum(lens),), generator=g)
    with torch.no_grad():
        plan = TorchAttentionBackend().plan(BatchLayout.packed(lens))
        hidden = loaded.model(ids, plan, None, compute_logits=False).hidden
        outs = rollout(head, PackedBatch(ids, hidden, torch.ones(len(ids), dtype=torch.bool), lens))
    train = [head.logits(o.features) for o in outs]  # step k at row t predicts x_{t+k+1}

    # The engine on the second sequence alone: refill entries j = (h_j, x_{j+1}) for
    # j = 0..m, then draft steps 2 and 3 at entry m with the true tokens x_{m+2}, x_{m+3}.
    off, n = lens[0], lens[1]
    x, h = ids[off:], hidden[off:]
    m, ps = n - 4, 4
    pages = list(range(-(-n // ps)))
    d = HeadDrafter(head, len(pages), ps, "cpu", torch.float32)
    d.bind(TorchAttentionBackend(), False)
    with torch.no_grad():
        lay = BatchLayout([m + 1], [m + 1], [pages], ps)
        state, logits = d.run(x[1:m + 2], head.first_hidden(h[:m + 1], None), d.backend.plan(lay))
        torch.testing.assert_close(logits, train[0][off:off + m + 1], atol=1e-5, rtol=1e-5)
        state = state[m:]
        for k in (2, 3):
            lay = BatchLayout([1], [m + k], [pages], ps)
            state, logits = d.run(x[m + k:m + k + 1], state, d.backend.plan(lay), k=k)
            torch.testing.assert_close(logits[0], train[k - 1][off + m], atol=1e-5, rtol=1e-5)
