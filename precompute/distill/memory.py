"""The distill stage in memory: answers and captured states as training records, no files.

Online training with regeneration (train/online.py) runs this instead of writing shards: the
same fixed batches, seeds and record rules as a distill run with shards_dir (shards.py), so
its records, in batch order, are the records those shards hold, state for state.
"""
from __future__ import annotations

import time
from pathlib import Path

from inference_eval.engine.capture import CaptureSpec
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.target import LoadedTarget
from precompute.capture import CapturedRecord, capture_dtype
from precompute.config import aux_layer_ids
from precompute.data import LoadReport, load_prompts
from precompute.distill.answer import answer_batches
from precompute.distill.config import DistillConfig
from precompute.distill.ledger import DistillLedger
from precompute.distill.run import _with_system, records_of


def answer_in_memory(cfg: DistillConfig, loaded: LoadedTarget, rank: int, world: int,
                     on_batch=None) -> tuple[dict[int, list[CapturedRecord]], list[dict],
                                             LoadReport]:
    """This rank's fixed batches answered with capture on.

    Returns ({first prompt index of the batch: its records}, rejects {"id", "reason",
    "detail"} of the load, the stage and the record rules, the load report).
    on_batch(prompts, generated_tokens, seconds) is called after each batch (progress)."""
    result = load_prompts(cfg.data)
    prompts = [_with_system(p, cfg.data.system_prompt) for p in result.conversations]
    tok = loaded.tokenizer
    if tok is None:
        raise ValueError(f"target {cfg.target.name!r} has no tokenizer; regeneration needs one")
    aux = aux_layer_ids(cfg.aux, loaded.model.arch.num_layers)
    engine = LLMEngine(loaded.model, tok, cfg.engine,
                       capture=CaptureSpec(aux, capture_dtype(cfg.hidden_dtype)))
    ledger = DistillLedger(Path(), "", prompts, rank, world)  # only its batch plan is used
    rejects = [{"id": r.id, "reason": r.reason, "detail": r.detail} for r in result.rejected]
    out: dict[int, list[CapturedRecord]] = {}
    t0 = time.perf_counter()
    for first, kept, dropped, last in answer_batches(
            engine, prompts, ledger.fixed_batches(cfg.engine.max_batch_size), cfg.sampling,
            cfg.turns, result.report.source, cfg.engine.seed, keep_last=True):
        out[first], bad = records_of(tok, kept, last, cfg.data.max_length)
        rejects += [{k: r[k] for k in ("id", "reason", "detail")} for r in dropped] + bad
        if on_batch is not None:
            now = time.perf_counter()
            on_batch(len(kept) + len(dropped),
                     sum(r["generated_tokens"] for r in kept + dropped), now - t0)
            t0 = now
    return out, rejects, result.report

