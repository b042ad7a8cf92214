"""The precompute job: chats -> tokenized records -> shard plan -> shards + manifest.

This file only orchestrates; each step lives in its own module:
- loading and validating chats, chat template and loss mask: precompute/data/
- the target's own answers (data.regenerate): precompute/regenerate.py, which runs the
  self-distillation stage precompute/distill/ into output_dir/distill; that stage writes
  the shards itself from the states captured while generating (no second prefill)
- what identifies a plan (tokenizer, records, settings): precompute/identity.py
- the shard plan and its batches: precompute/plan.py; the forward passes: precompute/dump.py
- shard files: precompute/shard_io.py; the manifest: precompute/manifest.py
- resume bookkeeping (progress files, finished manifest, clearing): precompute/resume.py
- the summary and `dry_run=true`: precompute/summary.py
- ranks and barriers under torchrun: precompute/distributed.py; with engine.tensor_parallel=T
  the data-parallel ranks are the world/T replicas' leaders: precompute/tensor_parallel.py

Resumable: every finished shard is recorded (per rank) in a progress file written after the
shard's atomic rename, so a kill at any point loses at most the shard in flight, and a rerun
computes the missing shards with the same batches, so the same bytes. Under torchrun each rank
takes shards k with k % world == rank of one global plan, so the files are the same as a
single process writes; rank 0 merges the progress files into manifest.json. Under
engine.tensor_parallel=T the same holds with world/T replicas as the ranks.

Byte equality holds between runs with the same device and BLAS thread count: OpenBLAS sums in
a different order with 1 and 2 threads (last-bit differences that bf16 rounding mostly, not
always, hides). Shards from different settings are equally valid; only their sha256s differ.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from inference_eval.engine.attention import make_backend
from inference_eval.engine.model.linear import set_cpu_blas
from inference_eval.engine.target import load_target
from precompute.config import PrecomputeConfig
from precompute.data import (
    LoadResult,
    TokenizedRecord,
    load_conversations,
    tokenize_conversations,
)
from precompute.distributed import dist_info, process_group, rank_device
from precompute.dump import build_shard
from precompute.identity import shard_plan_hash, tokenizer_identity
from precompute.manifest import Manifest, ShardEntry
from precompute.plan import plan_shards
from precompute.regenerate import refuse_unfinished_distill, regenerated_shards
from precompute.resume import ShardLedger, shard_name
from precompute.shard_io import write_shard
from precompute.summary import dry_run, print_regenerated, print_summary
from precompute.tensor_parallel import Replica, check_launch, dump_engine, run_replicated


def main(cfg: PrecomputeConfig) -> Manifest | None:
    if cfg.engine.tensor_parallel > 1 and not cfg.dry_run:
        check_launch(cfg.engine.tensor_parallel)
        follow_cfg = cfg.engine if cfg.data.regenerate else dump_engine(cfg.engine)
        return run_replicated(cfg.target, cfg.engine, follow_cfg,
                              lambda replica: _run(cfg, replica.rank, replica.world, replica))
    rank, world = dist_info()
    with process_group(world):
        return _run(cfg, rank, world)


def _run(cfg: PrecomputeConfig, rank: int, world: int,
         replica: Replica | None = None) -> Manifest | None:
    t_start = time.perf_counter()
    out = Path(cfg.output_dir)
    if cfg.engine.threads:
        torch.set_num_threads(cfg.engine.threads)
    # Data first: a missing or unreadable input fails in seconds, not after loading a 70B model.
    # data.regenerate reads prompts only (data=mix holds nothing else; the dry run counts the
    # original turns).
    result = load_conversations(cfg.data, prompts=cfg.data.regenerate and not cfg.dry_run)
    refuse_unfinished_distill(cfg)
    if cfg.dry_run:
        return dry_run(cfg, result, rank)
    if replica is None:
        loaded = load_target(cfg.target, device=rank_device(cfg.engine.resolve_device(), world))
    else:  # this replica's leader: its shard (tensor_parallel.py)
        loaded = replica.load()
    model, tok = loaded.model, loaded.tokenizer
    if tok is None:
        raise ValueError(f"target {cfg.target.name!r} has no tokenizer; precompute needs one")
    aux_layers = cfg.aux_layer_ids(model.arch.num_layers)
    if cfg.data.regenerate:  # answers and shards in one pass (precompute/regenerate.py)
        manifest = regenerated_shards(cfg, loaded, rank, world, replica)
        if manifest is not None:
            print_regenerated(out, manifest, time.perf_counter() - t_start)
        return manifest
    records = _records(cfg, result, tok)
    lengths = [len(r.input_ids) for r in records]
    shards = plan_shards(lengths, cfg.shard_tokens)
    tok_id = tokenizer_identity(tok)
    phash = shard_plan_hash(cfg, loaded.identity, tok_id, records, aux_layers)
    ledger = ShardLedger(out, phash, len(shards), rank, world,
                         group=None if replica is None else replica.group)
    finished = ledger.open(cfg.overwrite)
    if finished is not None:  # resume after completion: nothing to do, files kept as they are
        return finished
    manifest = Manifest(
        target={k: loaded.identity[k]
                for k in ("name", "source", "path", "arch", "weights_sha256")},
        tokenizer=tok_id, hidden_dtype=cfg.hidden_dtype, hidden_size=model.arch.hidden_size,
        aux_layers=aux_layers, plan_hash=phash, num_planned_shards=len(shards),
        data={"config": asdict(cfg.data), "load_report": result.report.to_dict(),
              "regeneration": {}, "max_length": cfg.data.max_length})
    todo = ledger.todo()
    # Tokens/s and ETA from a bar over tokens; the postfix says which shard is in flight.
    bar = tqdm(total=sum(lengths[i] for k in todo for i in shards[k]), unit="tok",
               unit_scale=True, desc=f"precompute[{rank}]", disable=not cfg.progress)
    # Under tensor parallelism the leader's calls run on its followers too (tensor_parallel.py
    # gives them the same settings: dump_engine), until the block ends.
    with nullcontext(loaded) if replica is None else replica.serve(loaded) as running:
        _write_shards(cfg, running.model, records, shards, todo, aux_layers, ledger, bar)
    bar.close()
    ledger.save()
    ledger.wait_for_all()
    if rank != 0:
        return None
    ledger.finish(manifest, result.rejected)
    print_summary(out, manifest, result, len(records), time.perf_counter() - t_start)
    return manifest


def _write_shards(cfg: PrecomputeConfig, model, records: list[TokenizedRecord],
                  shards: list[list[int]], todo: list[int], aux_layers: list[int],
                  ledger: ShardLedger, bar: tqdm) -> None:
    """The shards `todo` of the plan `shards` (record indices per shard), one after the
    other, each recorded in the ledger once it is renamed into place. model: the target, or
    under tensor parallelism the leader's model (tensor_parallel.LeaderModel)."""
    device, dtype = next(model.parameters()).device, model.lm_head_weight.dtype
    backend = make_backend(cfg.engine.attention, device, dtype)
    # Batches of thousands of rows: no product is small enough for the weights' block code.
    set_cpu_blas(model, device.type == "cpu" and dtype == torch.float32
                 and cfg.engine.cpu_blas != "torch", codes=False)
    for k in todo:
        recs = [records[i] for i in shards[k]]
        bar.set_postfix(shard=f"{k + 1}/{len(shards)}")
        shard = build_shard(model, backend, recs, batch_tokens=cfg.batch_tokens,
                            aux_layers=aux_layers, hidden_dtype=cfg.hidden_dtype,
                            on_batch=bar.update)
        digest = write_shard(Path(cfg.output_dir) / shard_name(k), shard)
        ledger.record(ShardEntry(file=shard_name(k), sha256=digest, sequences=len(recs),
                                 tokens=int(shard.cu_seqlens[-1]),
                                 loss_tokens=int(shard.loss_mask.sum()), index=k))


def _records(cfg: PrecomputeConfig, result: LoadResult, tok) -> list[TokenizedRecord]:
    records = list(tokenize_conversations(tok, result.conversations, cfg.data.max_length,
                                          cfg.data.system_prompt, report=result.report,
                                          rejected=result.rejected))
    if not records:
        raise ValueError(f"no usable conversations in {result.report.source} "
                         f"(rejected: {result.report.rejected})")
    return records
