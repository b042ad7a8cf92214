"""The precompute job: chats -> tokenized records -> shard plan -> shards + manifest.

Resumable: every finished shard is recorded (per rank) in a progress file written after the
shard's atomic rename, so a kill at any point loses at most the shard in flight, and a rerun
computes the missing shards with the same batches, so the same bytes. Under torchrun each rank
takes shards k with k % world == rank of one global plan, so the files are the same as a
single process writes; rank 0 merges the progress files into manifest.json.

Byte equality holds between runs with the same device and BLAS thread count: OpenBLAS sums in
a different order with 1 and 2 threads (last-bit differences that bf16 rounding mostly, not
always, hides). Shards from different settings are equally valid; only their sha256s differ.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from array import array
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
from tqdm.auto import tqdm

from inference_eval.engine.attention import make_backend
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.model.linear import set_cpu_blas
from inference_eval.engine.target import load_target
from precompute.config import PrecomputeConfig
from precompute.data import load_conversations, tokenize_conversations, write_rejects
from precompute.dump import build_shard
from precompute.manifest import Manifest, ShardEntry, write_json_atomic
from precompute.plan import plan_hash, plan_shards
from precompute.regenerate import regenerate
from precompute.shard_io import bytes_per_token, write_shard

# A barrier waits for the slowest rank to finish its last shard; gloo's default 30 minutes
# is shorter than one large shard of a big target on a slow device.
BARRIER_TIMEOUT = timedelta(hours=12)


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


def records_sha256(records) -> str:
    """Digest of every record's ids, tokens and loss mask: same lengths but other text is
    another plan, so a resume never mixes shards of two datasets."""
    h = hashlib.sha256()
    for r in records:
        h.update(r.id.encode() + b"\0")
        h.update(array("q", r.input_ids).tobytes())
        h.update(bytes(r.loss_mask))
    return h.hexdigest()


def main(cfg: PrecomputeConfig) -> Manifest | None:
    rank, world = dist_info()
    if world > 1:
        _init_process_group()
    try:
        return _run(cfg, rank, world)
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def _run(cfg: PrecomputeConfig, rank: int, world: int) -> Manifest | None:
    t_start = time.perf_counter()
    out = Path(cfg.output_dir)
    if cfg.engine.threads:
        torch.set_num_threads(cfg.engine.threads)
    # Data first: a missing or unreadable input fails in seconds, not after loading a 70B model.
    result = load_conversations(cfg.data)
    if cfg.dry_run:
        return _dry_run(cfg, result, rank)
    device = cfg.engine.resolve_device()
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    loaded = load_target(cfg.target, device=device)
    model, tok = loaded.model, loaded.tokenizer
    if tok is None:
        raise ValueError(f"target {cfg.target.name!r} has no tokenizer; precompute needs one")
    aux_layers = cfg.aux_layer_ids(model.arch.num_layers)
    records, regen_counts = _records(cfg, result, model, tok, rank)
    report = result.report
    lengths = [len(r.input_ids) for r in records]
    shards = plan_shards(lengths, cfg.shard_tokens)
    tok_id = tokenizer_identity(tok)
    phash = plan_hash({"target": loaded.identity["weights_sha256"], "tok": tok_id,
                       "records": records_sha256(records), "shard_tokens": cfg.shard_tokens,
                       "batch_tokens": cfg.batch_tokens, "hidden_dtype": cfg.hidden_dtype,
                       "aux": aux_layers, "dtype": cfg.target.dtype})
    finished, done = _open_output(out, cfg.overwrite, phash, len(shards), rank, world)
    if finished is not None:  # resume after completion: nothing to do, files kept as they are
        return finished
    manifest = Manifest(
        target={k: loaded.identity[k]
                for k in ("name", "source", "path", "arch", "weights_sha256")},
        tokenizer=tok_id, hidden_dtype=cfg.hidden_dtype, hidden_size=model.arch.hidden_size,
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
        _save_progress(progress_path, phash, my_entries)
    bar.close()
    _save_progress(progress_path, phash, my_entries)
    if world > 1:
        _barrier()
    if rank != 0:
        return None
    _finish(out, manifest, result)
    _print_summary(out, manifest, result, len(records), time.perf_counter() - t_start)
    return manifest


def _records(cfg: PrecomputeConfig, result, model, tok, rank: int):
    """(tokenized records, regeneration counts): regenerated answers first if asked."""
    convs, regen_counts = result.conversations, {}
    if cfg.data.regenerate:
        engine = LLMEngine(model, tok, cfg.engine)
        convs, regen_counts = regenerate(engine, convs, cfg.data,
                                         progress=cfg.progress and rank == 0)
    records = list(tokenize_conversations(tok, convs, cfg.data.max_length, cfg.data.system_prompt,
                                          report=result.report, rejected=result.rejected))
    if not records:
        raise ValueError(f"no usable conversations in {result.report.source} "
                         f"(rejected: {result.report.rejected})")
    return records, regen_counts


def _finish(out: Path, manifest: Manifest, result) -> None:
    """Rank 0, once every rank is done: merged manifest, rejects.jsonl, progress files gone."""
    merged = _done_entries(out, manifest.plan_hash)
    missing = [k for k in range(manifest.num_planned_shards) if k not in merged]
    if missing:
        raise RuntimeError(f"shards {missing[:5]} are missing after the run; rerun to resume")
    manifest.shards = [merged[k] for k in sorted(merged)]
    manifest.complete = True
    manifest.save(out / "manifest.json")
    write_rejects(out / "rejects.jsonl", result.rejected)
    _clear(out, with_results=False)


def _print_summary(out: Path, manifest: Manifest, result, kept: int, secs: float) -> None:
    report = result.report
    nbytes = sum((out / e.file).stat().st_size for e in manifest.shards)
    print(f"precompute done: kept {kept} records, rejected {len(result.rejected)} "
          f"{dict(sorted(report.rejected.items()))}, {manifest.num_tokens} tokens, "
          f"{len(manifest.shards)} shards, {nbytes / 1e6:.1f} MB "
          f"({nbytes / max(manifest.num_tokens, 1):.0f} B/token), {secs:.1f}s -> {out}")
    if report.truncated_tail:
        print(f"note: input was cut off mid-record; {report.tail_bytes_dropped} trailing bytes "
              "dropped, every complete record kept")


def _dry_run(cfg: PrecomputeConfig, result, rank: int) -> None:
    """Token and byte counts from the tokenizer and the architecture alone (no weights)."""
    from inference_eval.engine.target import load_tokenizer

    tok = load_tokenizer(cfg.target)
    if tok is None:
        raise ValueError(f"target {cfg.target.name!r} has no tokenizer; precompute needs one")
    arch = _target_arch(cfg)
    aux = cfg.aux_layer_ids(arch.num_layers)
    records = list(tokenize_conversations(tok, result.conversations, cfg.data.max_length,
                                          cfg.data.system_prompt, report=result.report,
                                          rejected=result.rejected))
    lengths = [len(r.input_ids) for r in records]
    per_token = bytes_per_token(arch.hidden_size, len(aux), cfg.hidden_dtype)
    shards = plan_shards(lengths, cfg.shard_tokens) if records else []
    tokens = sum(lengths)
    summary = {"records": len(records), "rejected": dict(sorted(result.report.rejected.items())),
               "tokens": tokens, "loss_tokens": sum(r.num_loss_tokens for r in records),
               "shards": len(shards), "bytes_per_token": per_token,
               "bytes_estimate": tokens * per_token + 8 * (len(records) + len(shards)),
               "hidden_dtype": cfg.hidden_dtype, "aux_layers": aux}
    if rank == 0:
        note = " (counts are for the original turns: data.regenerate is skipped)" \
            if cfg.data.regenerate else ""
        print(f"dry run, nothing written{note}: {tokens} tokens in {len(records)} records, "
              f"{len(shards)} shards, about {summary['bytes_estimate'] / 1e6:.1f} MB "
              f"({per_token} B/token)")
        print(json.dumps(summary))


def _target_arch(cfg: PrecomputeConfig):
    from inference_eval.engine.model.arch import ModelArch

    if cfg.target.source == "random":
        return ModelArch(**cfg.target.arch)
    from transformers import AutoConfig

    from inference_eval.engine.target import target_hf_dir

    return ModelArch.from_hf_config(AutoConfig.from_pretrained(target_hf_dir(cfg.target)))


def _open_output(out: Path, overwrite: bool, phash: str, num_shards: int, rank: int,
                 world: int) -> tuple[Manifest | None, dict[int, ShardEntry]]:
    """(manifest if this plan is already complete, shards already done) for `out`."""
    out.mkdir(parents=True, exist_ok=True)
    if overwrite and rank == 0:
        _clear(out, with_results=True)
    if overwrite and world > 1:
        _barrier()
    finished = _finished_manifest(out, phash, num_shards)
    if finished is not None and rank == 0:
        print(f"precompute: {out} already holds all {num_shards} shards of this plan; "
              "nothing to do (overwrite=true recomputes)")
    return finished, _done_entries(out, phash)


def _read_plan_file(p: Path, expected_hash: str) -> dict | None:
    if not p.is_file():
        return None
    d = json.loads(p.read_text())
    if d.get("plan_hash") != expected_hash:
        raise ValueError(
            f"{p} was written for a different plan (other data, target or settings); use a "
            f"new output_dir or overwrite=true")
    return d


def _finished_manifest(out: Path, expected_hash: str, num_shards: int) -> Manifest | None:
    """The manifest of a completed run of this plan whose shard files are all present."""
    d = _read_plan_file(out / "manifest.json", expected_hash)
    if d is None or not d.get("complete"):
        return None
    m = Manifest.load(out / "manifest.json")
    if len(m.shards) != num_shards or not all((out / e.file).is_file() for e in m.shards):
        return None
    return m


def _done_entries(out: Path, expected_hash: str) -> dict[int, ShardEntry]:
    """Shards already complete on disk for this plan (from manifest and progress files)."""
    entries: dict[int, ShardEntry] = {}
    for p in [out / "manifest.json"] + sorted(out.glob(".progress.rank*.json")):
        d = _read_plan_file(p, expected_hash)
        for s in (d or {}).get("shards", []):
            e = ShardEntry(**s)
            f = out / e.file
            if f.is_file() and f.stat().st_size > 0:
                entries[e.index] = e
    return entries


def _clear(out: Path, with_results: bool) -> None:
    """Remove progress files and temp files a kill left behind; with_results also the shards,
    the manifest and rejects.jsonl (overwrite=true)."""
    doomed = list(out.glob(".progress.rank*.json")) + list(out.glob(".*.tmp"))
    if with_results:
        doomed += list(out.glob("shard_*.safetensors")) + [out / "manifest.json",
                                                          out / "rejects.jsonl"]
    for p in doomed:
        p.unlink(missing_ok=True)


def _save_progress(path: Path, phash: str, entries: list[ShardEntry]) -> None:
    write_json_atomic(path, {"plan_hash": phash, "shards": [asdict(e) for e in entries]})


def _init_process_group() -> None:
    """gloo on every device: the job only needs barriers, and gloo works without GPUs."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=BARRIER_TIMEOUT)


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()
