"""data.regenerate=true: precompute trains on the target's own answers, from the distill stage.

Heads trained on the target's own outputs accept more at serving time, because that is the
distribution they will draft against. The answers come from the self-distillation stage
(precompute/distill/), run into `output_dir/distill` with every user turn answered
(regen_temperature, regen_max_new_tokens). That stage is cached and resumable on its own, so a
precompute resume or rerun reads the answers it already has and never generates them again.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.target import LoadedTarget
from precompute.config import PrecomputeConfig
from precompute.data import LoadResult, Rejected, load_file
from precompute.distill import DistillConfig, DistillManifest, run_distill
from precompute.distill.manifest import MANIFEST, PLAN_FILE
from precompute.distill.store import CONVERSATIONS


def distill_config(cfg: PrecomputeConfig) -> DistillConfig:
    """The distill stage data.regenerate runs: same target, data and engine, all turns."""
    return DistillConfig(
        target=cfg.target, data=replace(cfg.data, regenerate=False), engine=cfg.engine,
        sampling=SamplingParams(temperature=cfg.data.regen_temperature,
                                max_new_tokens=cfg.data.regen_max_new_tokens),
        output_dir=str(Path(cfg.output_dir) / "distill"), turns="all",
        overwrite=cfg.overwrite, progress=cfg.progress)


def training_conversations(cfg: PrecomputeConfig, result: LoadResult, loaded: LoadedTarget,
                           rank: int, world: int) -> tuple[LoadResult, dict]:
    """The chats precompute tokenizes and the regeneration summary for its manifest: `result`
    as loaded and {} without data.regenerate; else the distilled conversations, with the
    prompts the stage rejected listed (and counted) first."""
    if not cfg.data.regenerate:
        return result, {}
    dcfg = distill_config(cfg)
    run_distill(dcfg, rank, world, loaded=loaded)
    out = Path(dcfg.output_dir)
    distilled = load_file(out / CONVERSATIONS)
    lines = (out / "rejects.jsonl").read_text().splitlines()
    earlier = [Rejected(**json.loads(line)) for line in lines if line.strip()]
    for r in earlier:
        distilled.report.add_rejected(r)
    distilled.rejected[:0] = earlier
    m = DistillManifest.load(out / MANIFEST)
    summary = {"distill_dir": str(out), "plan_hash": m.plan_hash, "turns": m.turns,
               "sampling": m.sampling, "counts": m.counts,
               "generated_tokens": m.generated_tokens}
    return distilled, summary


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
