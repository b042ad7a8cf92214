"""Recipe features of the trainer (train/recipe.py, train/selection.py): epochs, the staged
rollout schedule, weights-only warm start, initialisation from the target's last layer, and
checkpoint selection / early stopping by the engine-measured real τ."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

import train.loop as loop
from heads.config import HeadConfig
from heads.frozen import load_frozen
from heads.registry import build_head
from inference_eval.engine.target import load_target
from inference_eval.hydra_app import compose
from train.config import TrainConfig
from train.recipe import init_from_target_layer, rollout_depth, stage_bounds, steps_from_epochs
from train.selection import Selection


def cfg_of(common, shards, out, *extra):
    return compose("train", TrainConfig, [*common, f"data.shards={shards}", f"output_dir={out}",
                                          *extra])


def test_epochs_derive_the_number_of_steps(common, shards, tmp_path, metrics):
    cfg = cfg_of(common, shards, tmp_path / "o", "trainer.epochs=2", "trainer.max_steps=999")
    store = loop.ShardStore(cfg.data.shards)
    per_epoch = len(store.batches(cfg.data.batch_tokens, cfg.trainer.seed, 0))
    loop.train(cfg)
    steps = [m["step"] for m in metrics(tmp_path / "o")]
    assert steps[-1] == 2 * per_epoch == steps_from_epochs(2, per_epoch, 1)
    assert steps_from_epochs(0.5, 11, 2) == math.ceil(5.5 / 2)


def test_staged_schedule_trains_k1_then_k3_and_saves_k3(common, shards, tmp_path, metrics):
    out = tmp_path / "o"
    cfg = cfg_of(common, shards, out, "trainer.max_steps=6",
                 "trainer.stages=[{num_steps:1,fraction:0.5},{num_steps:3,fraction:0.5}]")
    loop.train(cfg)
    lines = metrics(out)
    assert [m["rollout_k"] for m in lines] == [1, 1, 1, 3, 3, 3]
    assert [len(m["top1_acc"]) for m in lines] == [1, 1, 1, 3, 3, 3]
    assert json.loads((out / "config.json").read_text())["head"]["num_steps"] == 3
    assert stage_bounds(cfg.trainer.stages, 10) == [(5, 1), (10, 3)]
    assert [rollout_depth(cfg.trainer.stages, s, 10, 9) for s in (0, 4, 5, 9)] == [1, 1, 3, 3]


@pytest.mark.parametrize("bad, match", [
    ("trainer.stages=[{num_steps:1,fraction:0.5}]", "sum to 0.5"),
    ("trainer.stages=[{num_steps:3,fraction:0.5},{num_steps:1,fraction:0.5}]", "largest"),
])
def test_bad_stages_are_refused_naming_the_key(common, shards, tmp_path, bad, match):
    with pytest.raises(Exception, match=match):
        cfg_of(common, shards, tmp_path, bad)


def test_warm_start_reproduces_the_checkpoint_exactly(common, shards, tmp_path):
    first = tmp_path / "first"
    loop.train(cfg_of(common, shards, first, "trainer.max_steps=3"))
    saved = load_file(str(first / "model.safetensors"))
    # Another seed, so a head that ignored init_from would differ everywhere.
    cfg = cfg_of(common, shards, tmp_path / "second", f"trainer.init_from={first}",
                 "trainer.seed=7")
    _, _, head = loop.prepare(cfg)
    got = head.trainable_state()
    assert got.keys() == saved.keys()
    for k in saved:
        torch.testing.assert_close(got[k], saved[k].to(got[k].dtype), rtol=0, atol=0)
    fresh = loop.prepare(cfg_of(common, shards, tmp_path / "third", "trainer.seed=7"))[2]
    assert not torch.equal(fresh.trainable_state()["eh_proj.weight"], got["eh_proj.weight"])


def test_warm_start_from_another_head_type_is_refused(common, shards, tmp_path):
    first = tmp_path / "first"
    loop.train(cfg_of(common, shards, first, "trainer.max_steps=1"))
    with pytest.raises(ValueError, match="mtp"):
        loop.prepare(cfg_of(common, shards, tmp_path / "x", "head=eagle1",
                            f"trainer.init_from={first}"))


def test_init_from_target_copies_the_last_layer_and_final_norm(common, shards, tmp_path):
    cfg = cfg_of(common, shards, tmp_path / "o", "trainer.init_from_target=true")
    _, _, head = loop.prepare(cfg)
    target = load_target(cfg.target, with_tokenizer=False).model
    want = target.layers[-1].state_dict()
    got = head.layer.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    torch.testing.assert_close(head.final_norm.weight, target.norm.weight, rtol=0, atol=0)
    # eh_proj and the input norms keep their own initialisation
    assert torch.equal(head.enorm.weight, torch.ones_like(head.enorm.weight))


def test_init_from_target_refuses_heads_of_other_shapes(common, shards):
    cfg = compose("train", TrainConfig, [*common, "head=medusa"])
    parts = load_frozen(cfg.target)
    head = build_head(HeadConfig(type="medusa"), parts)
    with pytest.raises(ValueError, match="mtp\\|eagle1"):
        init_from_target_layer(head, {}, torch.ones(parts.arch.hidden_size))


def small_head(common):
    cfg = compose("train", TrainConfig, list(common))
    return build_head(cfg.head, load_frozen(cfg.target))


def test_selection_keeps_the_best_real_tau_and_stops_on_patience(common, tmp_path):
    head = small_head(common)
    sel = Selection(tmp_path, patience=2)
    taus = [1.2, 1.6, 1.5, 1.55]
    stops = []
    for i, tau in enumerate(taus, 1):
        with torch.no_grad():
            head.eh_proj.weight.fill_(float(i))  # which step's weights were saved
        stops.append(sel.update(10 * i, 1000 * i, {"real_tau": tau,
                                                   "real_per_position_accept_rate": [tau - 1]}, head))
    assert stops == [False, False, False, True]
    best = json.loads((tmp_path / "checkpoints" / "best" / "config.json").read_text())
    assert best["selection"]["value"] == 1.6 and best["selection"]["step"] == 20
    w = load_file(str(tmp_path / "checkpoints" / "best" / "model.safetensors"))["eh_proj.weight"]
    assert torch.all(w == 2.0)
    curve = json.loads((tmp_path / "acceptance_curve.json").read_text())
    assert [p["real_tau"] for p in curve["points"]] == taus
    assert [p["train_tokens"] for p in curve["points"]] == [1000, 2000, 3000, 4000]
    assert (tmp_path / "acceptance_curve.png").stat().st_size > 0
    # a resumed run reads its curve back and keeps comparing against the best so far
    again = Selection(tmp_path, patience=2)
    assert again.best["step"] == 20


def fake_validator(taus):
    """A Validator stand-in that reports the given real τ values in order."""
    taus = iter(taus)

    class FakeValidator:
        def __init__(self, cfg):
            pass

        def __call__(self, head, autocast=None):
            return {"real_tau": next(taus), "real_per_position_accept_rate": [0.1],
                    "real_num_prompts": 1}

    return FakeValidator


def test_training_stops_early_and_keeps_the_best_head(common, shards, tmp_path, monkeypatch,
                                                      metrics):
    monkeypatch.setattr(loop, "Validator", fake_validator([1.1, 1.4, 1.3, 1.2, 1.9, 2.0]))
    out = tmp_path / "o"
    loop.train(cfg_of(common, shards, out, "validation.enabled=true", "trainer.eval_every=2",
                      "trainer.max_steps=12", "trainer.early_stop_patience=2"))
    # validations at steps 2, 4, 6, 8: τ 1.1, 1.4, 1.3, 1.2 -> two without improvement: stop
    assert [m["step"] for m in metrics(out) if "val/real_tau" in m] == [2, 4, 6, 8]
    assert json.loads((out / "config.json").read_text())["train"]["steps"] == 8
    best = json.loads((out / "checkpoints" / "best" / "config.json").read_text())
    assert best["selection"]["step"] == 4 and best["selection"]["value"] == 1.4


def test_a_warm_start_is_scored_at_step_0_and_kept_when_training_loses(common, shards, tmp_path,
                                                                        monkeypatch, metrics):
    first = tmp_path / "first"
    loop.train(cfg_of(common, shards, first, "trainer.max_steps=2"))
    start = load_file(str(first / "model.safetensors"))
    # the warm start, then two worse validations
    monkeypatch.setattr(loop, "Validator", fake_validator([1.5, 1.2, 1.3]))
    out = tmp_path / "o"
    loop.train(cfg_of(common, shards, out, "validation.enabled=true", "trainer.eval_every=2",
                      "trainer.max_steps=4", f"trainer.init_from={first}", "optim.lr=0.05"))
    assert [m["step"] for m in metrics(out) if "val/real_tau" in m] == [0, 2, 4]
    curve = json.loads((out / "acceptance_curve.json").read_text())["points"]
    assert [(p["step"], p["train_tokens"]) for p in curve][0] == (0, 0)
    best = json.loads((out / "checkpoints" / "best" / "config.json").read_text())
    assert best["selection"]["step"] == 0
    kept = load_file(str(out / "checkpoints" / "best" / "model.safetensors"))
    final = load_file(str(out / "model.safetensors"))
    assert not torch.equal(final["eh_proj.weight"], start["eh_proj.weight"])  # it did train
    for k in start:
        torch.testing.assert_close(kept[k].float(), start[k].float(), rtol=0, atol=0)
