"""Block drafters in speculators' formats (the PyPI `speculators` package, the format vLLM
loads): our DFlash and P-EAGLE exports load with its own model classes and give our draft
logits on the same inputs, and the exported directories come back into our engine with
identical drafts.

No skip: if the package is missing, these tests fail (scripts/setup_env.sh installs it).
"""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from engine_cases import load_tiny, random_prompts
from heads.batch import PackedBatch
from heads.checkpoint import load_head, read_head_config, save_head
from heads.config import HeadConfig
from heads.formats import export_head
from heads.registry import build_head
from heads.rollout import rollout
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.sampling import SamplingParams
from inference_eval.evaluation.engines import build_engine, frozen_parts_of

H, V = 96, 320  # the tiny HF family's hidden size and vocabulary
AUX = [0, 1, 2]


@pytest.fixture(scope="module")
def loaded(tiny_hf):
    return load_tiny(tiny_hf)  # llama3: its rope scaling is exported too


DRAFT_VOCAB = torch.arange(3, V, 4)  # a reduced vocabulary: 80 of the 320 tokens
# DSpark: DFlash plus the transition bias (d_1's from the anchor) and the confidence head
SPARK = dict(markov_rank=4, markov_first=True, confidence_head=True)


def _head(loaded, kind: str, seed: int = 5):
    dflash = dict(type="dflash", num_steps=3, num_layers=2, aux_layers=AUX, mask_token_id=17)
    cfg = {"dflash": HeadConfig(**dflash),
           "dspark": HeadConfig(**dflash, **SPARK),
           "dspark_reduced": HeadConfig(**dflash, **SPARK, draft_vocab_size=DRAFT_VOCAB.numel()),
           "peagle": HeadConfig(type="eagle3", num_steps=3, aux_layers=AUX,
                                parallel_drafting=True),
           # as published P-EAGLE heads: a fused first layer, then plain decoder layers
           "peagle_3layers": HeadConfig(type="eagle3", num_steps=3, aux_layers=AUX,
                                        parallel_drafting=True, num_layers=3)}[kind]
    head = build_head(cfg, frozen_parts_of(loaded), seed=seed,
                      draft_vocab=DRAFT_VOCAB if cfg.draft_vocab_size else None)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every tensor random, so a swapped or dropped one changes the logits
        for name, p in head.named_parameters():
            if p.requires_grad:
                p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + 0.2 * torch.randn(p.shape, generator=g))
    return head.eval()


def _fill_verifier(model):
    """speculators marks verifier-owned weights with a NaN sentinel and fills them in
    load_verifier_weights; transformers 5.20+ leaves them uninitialized (as in
    test_export_speculators.py)."""
    with torch.no_grad():
        model.embed_tokens.weight.fill_(math.nan)
        if not model.use_draft_vocab:
            model.lm_head.weight.fill_(math.nan)
    model.load_verifier_weights()
    return model


def _inputs(n: int, seed: int = 11):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (n,), generator=g), torch.randn(n, 3, H, generator=g)


def test_speculators_dflash_reproduces_our_block_logits(loaded, tmp_path):
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    head = _head(loaded, "dflash")
    save_head(head, tmp_path / "ours")
    out = export_head(tmp_path / "ours", "speculators", tmp_path / "spec")
    raw = json.loads((out / "config.json").read_text())
    assert raw["speculators_model_type"] == "dflash" and raw["block_size"] == 4
    assert raw["aux_hidden_state_layer_ids"] == [1, 2, 3] and raw["mask_token_id"] == 17
    assert raw["sample_from_anchor"] is False
    cfg = DFlashSpeculatorConfig.from_pretrained(str(out))
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = _fill_verifier(DFlashDraftModel.from_pretrained(str(out), config=cfg).eval())
    assert len(model.layers) == 2 and model.block_size == 4

    n, b = 14, 4
    ids, aux = _inputs(n)
    anchors = torch.arange(n - b)  # speculators anchors every loss position but the last B
    with torch.no_grad():
        ours = head.logits(head.train_blocks(aux, [n], ids, anchors).reshape(-1, H))
        _, theirs, _, _, _ = model._backbone_forward(
            hidden_states=aux.reshape(1, n, 3 * H), input_ids=ids[None],
            loss_mask=torch.ones(1, n), verifier_last_hidden_states=torch.zeros(1, n, H),
            document_ids=torch.zeros(1, n, dtype=torch.long), max_anchors=n - b)
    assert theirs.shape == (1, (n - b) * b, V)
    torch.testing.assert_close(theirs[0], ours, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["dspark", "dspark_reduced"])
def test_speculators_dspark_reproduces_our_biased_logits_and_confidences(loaded, tmp_path,
                                                                        monkeypatch, kind):
    """Our DFlash head with the transition bias and the confidence head is speculators'
    DSpark: its forward's Markov-biased logits and confidence logits (captured where it hands
    them to its loss) are ours on the same inputs; a reduced vocabulary's lm_head rows are the
    target's, which the export reads from the checkpoint's target."""
    import speculators.models.dspark.core as dspark_core
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    head = _head(loaded, kind)
    save_head(head, tmp_path / "ours")
    out = export_head(tmp_path / "ours", "speculators", tmp_path / "spec")
    raw = json.loads((out / "config.json").read_text())
    assert raw["speculators_model_type"] == "dspark" and raw["markov_rank"] == 4
    assert raw["enable_confidence_head"] and raw["confidence_head_with_markov"]
    assert raw["sample_from_anchor"] is False
    cfg = DSparkSpeculatorConfig.from_pretrained(str(out))
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = _fill_verifier(DSparkDraftModel.from_pretrained(str(out), config=cfg).eval())
    assert model.use_draft_vocab == (kind == "dspark_reduced")

    n, b = 14, 4
    ids, aux = _inputs(n)
    got = {}

    def capture(logits, targets, confidence_logits, *a, **kw):
        got["logits"], got["conf"] = logits, confidence_logits
        return torch.zeros(()), {}

    monkeypatch.setattr(dspark_core, "compute_metrics", capture)
    anchors = torch.arange(n - b)
    with torch.no_grad():
        model(hidden_states=aux.reshape(1, n, 3 * H), input_ids=ids[None],
              loss_mask=torch.ones(1, n), verifier_last_hidden_states=torch.zeros(1, n, H),
              document_ids=torch.zeros(1, n, dtype=torch.long), max_anchors=n - b)
        feats = head.train_blocks(aux, [n], ids, anchors)  # [J, B, H]
        # row k's previous token is the data's x_{a+k-1}: the anchor itself for row 1
        prev = torch.stack([ids[anchors + k - 1] for k in range(1, b)], 1)  # [J, B-1]
        drafts = feats[:, 1:].reshape(-1, H)
        ours = head.logits(drafts).float() + head.transition(prev.reshape(-1))
        conf = head.confidence_logit(drafts, prev.reshape(-1))
    theirs = got["logits"][0].view(n - b, b, -1)[:, 1:].reshape(-1, ours.shape[-1])
    torch.testing.assert_close(theirs.float(), ours, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["conf"][0].view(n - b, b)[:, 1:].reshape(-1).float(), conf.float(),
                               rtol=1e-4, atol=1e-4)
    if kind == "dspark_reduced":
        target_rows = frozen_parts_of(loaded).lm_head[DRAFT_VOCAB]
        torch.testing.assert_close(model.lm_head.weight.detach(), target_rows.to(model.lm_head.weight.dtype))


@pytest.mark.parametrize("kind", ["peagle", "peagle_3layers"])
def test_speculators_peagle_reproduces_our_parallel_steps(loaded, tmp_path, monkeypatch, kind):
    import speculators.models.peagle.core as peagle_core
    from speculators.losses import resolve_loss_config
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    head = _head(loaded, kind)
    save_head(head, tmp_path / "ours")
    out = export_head(tmp_path / "ours", "speculators", tmp_path / "spec")
    raw = json.loads((out / "config.json").read_text())
    assert raw["speculators_model_type"] == "peagle" and raw["mask_token_id"] == V - 1
    cfg = PEagleSpeculatorConfig.from_pretrained(str(out))
    cfg.transformer_layer_config._attn_implementation = "eager"
    model = _fill_verifier(PEagleDraftModel.from_pretrained(str(out), config=cfg).eval())
    assert len(model.layers) == head.cfg.num_layers

    n, k = 9, 3
    ids, aux = _inputs(n)
    # Every position at depth 0, and positions 0..n-1-d at depth d: their element (t, d) is
    # our rollout's step d + 1 at t (their ids arrive shifted: ids[t] = x_{t+1}).
    anchor = torch.cat([torch.arange(n - d) for d in range(k)])
    depth = torch.cat([torch.full((n - d,), d) for d in range(k)])
    monkeypatch.setattr(peagle_core, "generate_cod_sample_indices", lambda **kw: (anchor, depth))
    theirs = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: theirs.append(o[0].clone()))
    shifted = torch.cat([ids[1:], torch.zeros(1, dtype=ids.dtype)])
    with torch.no_grad():
        model(hidden_states=aux.reshape(1, n, 3 * H), input_ids=shifted[None],
              document_ids=torch.zeros(1, n, dtype=torch.long), position_ids=torch.arange(n)[None],
              loss_mask=torch.ones(1, n), verifier_last_hidden_states=torch.zeros(1, n, H),
              num_depths=k, loss_config=resolve_loss_config("kl_div", "eager"))
        outs = rollout(head, PackedBatch(ids, torch.zeros(n, H), torch.ones(n, dtype=torch.bool),
                                         [n], aux))
    hook.remove()
    start = 0
    for d in range(k):
        ours = head.logits(outs[d].features[:n - d])
        torch.testing.assert_close(theirs[0][start:start + n - d], ours, rtol=1e-4, atol=1e-4,
                                   msg=f"depth {d}")
        start += n - d


@pytest.mark.parametrize("kind", ["dflash", "peagle", "peagle_3layers", "dspark", "dspark_reduced"])
def test_export_round_trips_into_our_engine_with_identical_drafts(loaded, tmp_path, kind):
    head = _head(loaded, kind)
    save_head(head, tmp_path / "ours")
    export_head(tmp_path / "ours", "speculators", tmp_path / "spec")
    meta = read_head_config(tmp_path / "spec")
    assert meta["format"] == "speculators" and meta["head"]["type"] == head.cfg.type
    back = load_head(tmp_path / "spec", frozen_parts_of(loaded))
    assert back.cfg.num_steps == 3 and back.drafting == head.drafting
    assert back.mask_id == head.mask_id
    sd, bd = head.trainable_state(), back.trainable_state()
    assert sd.keys() == bd.keys() and all(torch.equal(sd[k], bd[k]) for k in sd)
    prompts = random_prompts(3, 8, 20)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    runs = []
    # DSpark's drafts cut where its confidence head predicts little acceptance
    cut = 0.5 if head.cfg.confidence_head else 0.0
    for path in (tmp_path / "ours", tmp_path / "spec"):
        eng = build_engine(loaded, EngineConfig(attention="torch", page_size=4), SimpleNamespace(
            kind="head", checkpoint=str(path), num_draft=3, scheme="chain", min_confidence=cut))
        got = eng.generate(prompts, params, progress=False)
        runs.append([(r.token_ids, r.meta["proposed"], r.meta["accepted"]) for r in got])
    assert runs[0] == runs[1]


def test_a_dspark_head_that_drafts_from_its_anchor_is_refused(loaded, tmp_path):
    """DSpark's default is sample_from_anchor=true (the anchor row drafts too): a config that
    leaves it out means that, which our head cannot run."""
    save_head(_head(loaded, "dspark"), tmp_path / "ours")
    out = export_head(tmp_path / "ours", "speculators", tmp_path / "spec")
    raw = json.loads((out / "config.json").read_text())
    del raw["sample_from_anchor"]
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="sample_from_anchor=true"):
        load_head(out, frozen_parts_of(loaded))


def test_a_bias_that_spares_d1_is_refused_by_dspark(loaded, tmp_path):
    cfg = HeadConfig(type="dflash", num_steps=3, aux_layers=AUX, markov_rank=4)
    save_head(build_head(cfg, frozen_parts_of(loaded)), tmp_path / "ours")
    with pytest.raises(ValueError, match="dspark.*head.markov_first=true"):
        export_head(tmp_path / "ours", "speculators", tmp_path / "spec")


def test_peagle_is_refused_by_the_plain_eagle3_format(loaded, tmp_path):
    save_head(_head(loaded, "peagle"), tmp_path / "ours")
    with pytest.raises(ValueError, match="no P-EAGLE variant.*speculators"):
        export_head(tmp_path / "ours", "eagle3", tmp_path / "e3")
