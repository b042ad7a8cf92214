"""Real client: the PyPI `speculators` package (the format vLLM loads) reads our EAGLE-3 export
with its own model class, and its forward gives our draft logits on the same inputs.

Installed by scripts/setup_env.sh (speculators without its torch/vision/audio pins). No skip:
if the package is missing, this test fails.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from heads.batch import PackedBatch
from heads.checkpoint import save_head
from heads.frozen import load_frozen
from heads.rollout import rollout
from inference_eval.engine.target import TargetConfig
from test_export import H, V, make_head
from heads.formats import export_head


@pytest.fixture(scope="module")
def target(tiny_hf):
    d, _ = tiny_hf("llama3")  # llama3 rope scaling: the exported rope config is exercised too
    return d, load_frozen(TargetConfig(name="tiny-llama3", source="hf", path=str(d)))


def load_with_speculators(path):
    """Eagle3DraftModel.from_pretrained on our export, eager attention (its flex-attention
    default needs lengths that are multiples of 128)."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    cfg = Eagle3SpeculatorConfig.from_pretrained(str(path))
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(str(path), config=cfg).eval()
    # speculators marks verifier-owned weights absent from the checkpoint with a NaN sentinel
    # and fills them in load_verifier_weights; transformers 5.20+ (it pins <= 5.19) leaves them
    # uninitialized instead, so restore the sentinel and let its own loader fill them.
    with torch.no_grad():
        model.embed_tokens.weight.fill_(math.nan)
        if not model.use_draft_vocab:  # full vocabulary: lm_head is the verifier's
            model.lm_head.weight.fill_(math.nan)
    model.load_verifier_weights()
    return model


@pytest.mark.parametrize("reduced, layers", [(True, 1), (False, 1), (True, 2)])
def test_speculators_eagle3_model_reproduces_our_draft_logits(reduced, layers, target, tmp_path):
    tdir, parts = target
    steps, n = 3, 13
    head = make_head("eagle3", parts, reduced=reduced, steps=steps, layers=layers).eval()
    save_head(head, tmp_path / "ours")
    out = export_head(tmp_path / "ours", "speculators", tmp_path / "vllm")
    # vLLM reads these keys itself and fills a missing norm_before_residual with TRUE.
    raw = json.loads((out / "config.json").read_text())
    assert raw["norm_before_residual"] is False and raw["speculators_model_type"] == "eagle3"
    assert raw["specheads_target"]["frozen_sha256"] == parts.identity["frozen_sha256"]
    model = load_with_speculators(out)
    assert model.config.speculators_config.verifier.name_or_path == str(tdir)
    assert model.config.eagle_aux_hidden_state_layer_ids == [1, 2, 3]
    assert len(model.layers) == layers

    g = torch.Generator().manual_seed(11)
    x = torch.randint(0, V, (n,), generator=g)
    aux = torch.randn(n, 3, H, generator=g)
    with torch.no_grad():
        ours = [head.logits(o.features) for o in rollout(head, PackedBatch(
            x, torch.zeros(n, H), torch.ones(n, dtype=torch.bool), [n], aux))]
    # Their step 1 at position t reads aux_t and token x_{t+1} (input ids shifted left, 0 past
    # the end, as our rollout pads); later steps shift the ids themselves, like ours.
    ids = torch.cat([x[1:], torch.zeros(1, dtype=x.dtype)])
    theirs = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: theirs.append(o[0].clone()))
    with torch.no_grad():
        draft = model(hidden_states=aux.reshape(1, n, 3 * H), input_ids=ids[None],
                      document_ids=torch.zeros(1, n, dtype=torch.long),
                      position_ids=torch.arange(n)[None], ttt_steps=steps)
    hook.remove()
    assert len(theirs) == steps
    for k, (a, b) in enumerate(zip(ours, theirs), 1):
        assert a.shape == b.shape == (n, 80 if reduced else V), k
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=f"draft step {k}")
    # Same vocabulary maps: their d2t offsets + draft id = our absolute ids.
    d2t = head.draft_to_target()
    if reduced:
        assert torch.equal(model.d2t + torch.arange(80), d2t)
        assert torch.equal(model.t2d.nonzero().flatten(), d2t)
    else:
        assert d2t is None and model.d2t is None
    assert torch.equal(draft[0][0], ours[0].argmax(-1))
