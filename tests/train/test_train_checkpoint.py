"""The head checkpoint a training run leaves in output_dir loads back (heads.checkpoint) and
gives bit-identical logits to the head the trainer held in memory."""
from __future__ import annotations

import pytest
import torch

import train.loop as loop
from heads.checkpoint import load_head, read_head_config
from heads.frozen import load_frozen
from heads.rollout import rollout
from inference_eval.hydra_app import compose
from train.config import TrainConfig
from train.data import ShardStore


def test_trained_head_checkpoint_loads_back_with_identical_logits(shards, common, tmp_path,
                                                                   monkeypatch):
    out = tmp_path / "run"
    cfg = compose("train", TrainConfig, [*common, "head.num_steps=2", f"data.shards={shards}",
                                         f"output_dir={out}", "trainer.max_steps=3"])
    held = {}
    real_save = loop.save_final_head

    def capture(full, path, extra):
        held["head"] = full.module  # the head the trainer held in memory
        return real_save(full, path, extra)

    monkeypatch.setattr(loop, "save_final_head", capture)
    loop.train(cfg)

    trained = held["head"].eval()
    parts = load_frozen(cfg.target)
    back = load_head(out, parts, expect_type="mtp").eval()
    meta = read_head_config(out)
    assert meta["head"]["num_steps"] == 2 and meta["train"]["steps"] == 3
    assert meta["target"]["weights_sha256"] == parts.identity["weights_sha256"]
    fresh = loop.build_head(cfg.head, parts, seed=cfg.trainer.seed)
    assert not torch.equal(fresh.eh_proj.weight, back.eh_proj.weight)  # it did train

    store = ShardStore(shards)
    batch = store.collate(list(range(6)))
    with torch.no_grad():
        outs_t, outs_b = rollout(trained, batch), rollout(back, batch)
        for a, b in zip(outs_t, outs_b):
            torch.testing.assert_close(back.logits(b.features), trained.logits(a.features),
                                       rtol=0, atol=0)
        loss_t, _ = trained(batch)
        loss_b, _ = back(batch)
    assert loss_t.item() == loss_b.item()

    with pytest.raises(ValueError, match="holds a 'mtp' head, but head.type='eagle1'"):
        load_head(out, parts, expect_type="eagle1")
