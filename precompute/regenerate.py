"""data.regenerate=true: precompute trains on the target's own answers, from the distill stage.

Heads trained on the target's own outputs accept more at serving time, because that is the
distribution they will draft against. The answers come from the self-distillation stage
(precompute/distill/), run into `output_dir/distill` with every user turn answered
(regen_temperature, regen_max_new_tokens). The stage writes the shards itself, into
output_dir, from the hidden states the engine computed while generating the answers
(precompute/capture.py, precompute/distill/shards.py): no second prefill over prompt + answer.
Both the answers and the shards are resumable; a batch of prompts whose shards a kill lost is
answered again (the same requests, so the same bytes). A complete rerun does nothing.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.target import LoadedTarget
from precompute.config import PrecomputeConfig
from precompute.distill import DistillConfig, run_distill
from precompute.distill.manifest import PLAN_FILE
from precompute.distill.store import CONVERSATIONS
from precompute.manifest import Manifest


def distill_config(cfg: PrecomputeConfig) -> DistillConfig:
    """The distill stage data.regenerate runs: same target, data and engine, all turns."""
    return DistillConfig(
        target=cfg.target, data=replace(cfg.data, regenerate=False), engine=cfg.engine,
        sampling=SamplingParams(temperature=cfg.data.regen_temperature,
                                max_new_tokens=cfg.data.regen_max_new_tokens),
        output_dir=str(Path(cfg.output_dir) / "distill"), turns="all",
        overwrite=cfg.overwrite, progress=cfg.progress, shards_dir=cfg.output_dir,
        hidden_dtype=cfg.hidden_dtype, aux=cfg.aux, shard_tokens=cfg.shard_tokens)


def regenerated_shards(cfg: PrecomputeConfig, loaded: LoadedTarget, rank: int,
                       world: int, replica=None) -> Manifest | None:
    """data.regenerate: the distill stage answers and writes the shards in one pass; the
    shard manifest on rank 0, None elsewhere. replica: this replica's leader under tensor
    parallelism (precompute/tensor_parallel.py)."""
    run_distill(distill_config(cfg), rank, world, loaded=loaded, replica=replica)
    return Manifest.load(Path(cfg.output_dir) / "manifest.json") if rank == 0 else None


def refuse_unfinished_distill(cfg: PrecomputeConfig) -> None:
    """data.path pointing at the live file of a distill run that has not finished would train
    on part of the answers, silently; say how to finish it instead."""
    if cfg.data.source != "jsonl" or not cfg.data.path:
        return
    path = Path(cfg.data.path)
    if path.name == CONVERSATIONS and (path.parent / PLAN_FILE).is_file():
        raise ValueError(f"{path} is the output of a distill run that has not finished; rerun "
                         "`python -m precompute.distill` with the same settings to complete "
                         "it, then precompute")
