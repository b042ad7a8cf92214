"""The precompute job: chats -> tokenized records -> shard plan -> shards + manifest.

Resumable: every finished shard is recorded (per rank) in a progress file written after the
shard's atomic rename, so a kill at any point loses at most the shard in flight. Under
torchrun each rank takes shards k with k % world == rank of one global plan, so the files are
the same as a single process writes; rank 0 merges the progress files into manifest.json.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from inference_eval.attention import make_backend
from inference_eval.engine import LLMEngine
from inference_eval.model.linear import set_cpu_blas
from inference_eval.target import load_target
from precompute.config import PrecomputeConfig
from precompute.data import load_conversations, tokenize_conversations, write_rejects
from precompute.dump import build_shard
from precompute.manifest import Manifest, ShardEntry, write_json_atomic
from precompute.plan import plan_batches, plan_hash, plan_shards
from precompute.regenerate import regenerate
from precompute.shard_io import file_sha256, write_shard


def dist_info() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def tokenizer_identity(tok) -> dict:
    vocab = json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode()
    template = (tok.chat_template or "").encode()
    return {"class": type(tok).__name__, "vocab_size": len(tok),
            "vocab_sha256": hashlib.sha256(vocab).hexdigest(),
            "chat_template_sha256": hashlib.sha256(template).hexdigest()}


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.safetensors"


def _done_entries(out: Path, expected_hash: str) -> dict[int, ShardEntry]:
    """Shards already complete on disk for this plan (from manifest and progress files)."""
    entries: dict[int, ShardEntry] = {}
    sources = [out / "manifest.json"] + sorted(out.glob(".progress.rank*.json"))
    for p in sources:
        if not p.is_file():
            continue
        d = json.loads(p.read_text())
        if d.get("plan_hash") != expected_hash:
            raise ValueError(
                f"{p} was written for a different plan (other data, target or settings); use a "
                f"new output_dir or overwrite=true")
        for s in d["shards"]:
            e = ShardEntry(**s)
            f = out / e.file
            if f.is_file() and f.stat().st_size > 0:
                entries[e.index] = e
    return entries


def main(cfg: PrecomputeConfig) -> Manifest | None:
    rank, world = dist_info()
    t_start = time.perf_counter()
    out = Path(cfg.output_dir)
    device = cfg.engine.resolve_device()
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    loaded = load_target(cfg.target, device=device)
    model, tok = loaded.model, loaded.tokenizer
    if tok is None:
        raise ValueError(f"target {cfg.target.name!r} has no tokenizer; precompute needs one")
    aux_layers = cfg.aux_layer_ids(model.arch.num_layers)

    result = load_conversations(cfg.data)
    convs, report = result.conversations, result.report
    regen_counts = {}
    if cfg.data.regenerate:
        engine = LLMEngine(model, tok, cfg.engine)
        convs, regen_counts = regenerate(engine, convs, cfg.data, progress=cfg.progress and rank == 0)
    records = list(tokenize_conversations(tok, convs, cfg.data.max_length, cfg.data.system_prompt,
                                          report=report, rejected=result.rejected))
    if not records:
        raise ValueError(f"no usable conversations in {report.source} (rejected: {report.rejected})")
    lengths = [len(r.input_ids) for r in records]
    shards = plan_shards(lengths, cfg.shard_tokens)
    phash = plan_hash({"target": loaded.identity["weights_sha256"], "tok": tokenizer_identity(tok),
                       "records": [(r.id, len(r.input_ids), sum(r.loss_mask)) for r in records],
                       "shard_tokens": cfg.shard_tokens, "batch_tokens": cfg.batch_tokens,
                       "hidden_dtype": cfg.hidden_dtype, "aux": aux_layers,
                       "dtype": cfg.target.dtype})
    h = model.arch.hidden_size
    elt = 1 if cfg.hidden_dtype == "fp8" else torch.empty((), dtype=getattr(torch, cfg.hidden_dtype)).element_size()
    per_token = h * elt + 4 + 1 + (4 if cfg.hidden_dtype == "fp8" else 0) + len(aux_layers) * h * min(elt * 2, 2 if cfg.hidden_dtype == "fp8" else elt)
    total_tokens = sum(lengths)
    summary = {"records": len(records), "tokens": total_tokens,
               "loss_tokens": sum(sum(r.loss_mask) for r in records), "shards": len(shards),
               "bytes_estimate": total_tokens * per_token, "bytes_per_token": per_token}
    if cfg.dry_run:
        if rank == 0:
            print("dry run, nothing written:", json.dumps(summary))
        return None

    out.mkdir(parents=True, exist_ok=True)
    if cfg.overwrite and rank == 0:
        for p in list(out.glob("shard_*.safetensors")) + list(out.glob(".progress.rank*.json")) + [out / "manifest.json"]:
            p.unlink(missing_ok=True)
    if cfg.overwrite and world > 1:
        _barrier()
    done = _done_entries(out, phash)
    manifest = Manifest(
        target={k: loaded.identity[k] for k in ("name", "source", "path", "arch", "weights_sha256")},
        tokenizer=tokenizer_identity(tok), hidden_dtype=cfg.hidden_dtype, hidden_size=h,
        aux_layers=aux_layers, plan_hash=phash, num_planned_shards=len(shards),
        data={"config": asdict(cfg.data), "load_report": report.to_dict(),
              "regeneration": regen_counts, "max_length": cfg.data.max_length})
    mine = [k for k in range(len(shards)) if k % world == rank]
    progress_path = out / f".progress.rank{rank}.json"
    my_entries = [done[k] for k in mine if k in done]
    todo = [k for k in mine if k not in done]
    todo_tokens = sum(lengths[i] for k in todo for i in shards[k])
    # Tokens/s and ETA from a bar over tokens; the postfix says which shard is in flight.
    bar = tqdm(total=todo_tokens, unit="tok", unit_scale=True, desc=f"precompute[{rank}]",
               disable=not cfg.progress)
    backend = make_backend(cfg.engine.attention, device)
    set_cpu_blas(model, device.type == "cpu" and model.lm_head_weight.dtype == torch.float32
                 and cfg.engine.cpu_blas != "torch")
    for k in todo:
        recs = [records[i] for i in shards[k]]
        bar.set_postfix(shard=f"{k + 1}/{len(shards)}")
        shard = build_shard(model, backend, recs, batch_tokens=cfg.batch_tokens,
                            aux_layers=aux_layers, hidden_dtype=cfg.hidden_dtype,
                            on_batch=bar.update)
        digest = write_shard(out / shard_name(k), shard)
        my_entries.append(ShardEntry(file=shard_name(k), sha256=digest, sequences=len(recs),
                                     tokens=int(shard.cu_seqlens[-1]),
                                     loss_tokens=int(shard.loss_mask.sum()), index=k))
        write_json_atomic(progress_path, {"plan_hash": phash, "shards": [asdict(e) for e in my_entries]})
    bar.close()
    write_json_atomic(progress_path, {"plan_hash": phash, "shards": [asdict(e) for e in my_entries]})
    if world > 1:
        _barrier()
    if rank != 0:
        return None
    merged = _done_entries(out, phash)
    missing = [k for k in range(len(shards)) if k not in merged]
    if missing:
        raise RuntimeError(f"shards {missing[:5]} are missing after the run; rerun to resume")
    manifest.shards = [merged[k] for k in sorted(merged)]
    manifest.complete = True
    manifest.save(out / "manifest.json")
    n_rej = write_rejects(out / "rejects.jsonl", result.rejected)
    for p in out.glob(".progress.rank*.json"):
        p.unlink()
    secs = time.perf_counter() - t_start
    nbytes = sum((out / e.file).stat().st_size for e in manifest.shards)
    print(f"precompute done: kept {len(records)} records, rejected {n_rej} "
          f"{dict(sorted(report.rejected.items()))}, {manifest.num_tokens} tokens, "
          f"{len(manifest.shards)} shards, {nbytes / 1e6:.1f} MB "
          f"({nbytes / max(manifest.num_tokens, 1):.0f} B/token), {secs:.1f}s -> {out}")
    if report.truncated_tail:
        print(f"note: input was cut off mid-record; {report.tail_bytes_dropped} trailing bytes "
              "dropped, every complete record kept")
    return manifest


def _barrier() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    dist.barrier()
