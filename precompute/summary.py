"""What precompute prints: the end-of-run summary, and the dry run's estimate.

`dry_run=true` needs the tokenizer and the architecture only (no weights): it tokenizes the
data, plans the shards and prints the tokens and bytes it would write, then one JSON line.
"""
from __future__ import annotations

import json
from pathlib import Path

from precompute.config import PrecomputeConfig
from precompute.data import LoadResult, tokenize_conversations
from precompute.manifest import Manifest
from precompute.plan import plan_shards
from precompute.shard_io import bytes_per_token


def print_summary(out: Path, manifest: Manifest, result: LoadResult, kept: int,
                  secs: float) -> None:
    report = result.report
    nbytes = sum((out / e.file).stat().st_size for e in manifest.shards)
    print(f"precompute done: kept {kept} records, rejected {len(result.rejected)} "
          f"{dict(sorted(report.rejected.items()))}, {manifest.num_tokens} tokens, "
          f"{len(manifest.shards)} shards, {nbytes / 1e6:.1f} MB "
          f"({nbytes / max(manifest.num_tokens, 1):.0f} B/token), {secs:.1f}s -> {out}")
    if report.truncated_tail:
        print(f"note: input was cut off mid-record; {report.tail_bytes_dropped} trailing bytes "
              "dropped, every complete record kept")


def print_regenerated(out: Path, manifest: Manifest, secs: float) -> None:
    """The summary of a data.regenerate run (answers and shards in one pass)."""
    nbytes = sum((out / e.file).stat().st_size for e in manifest.shards)
    report = manifest.data.get("load_report", {})
    rejected = report.get("rejected", {})
    print(f"precompute done (answers and states in one pass): kept {report.get('kept')} "
          f"records, rejected {sum(rejected.values())} {rejected}, {manifest.num_tokens} "
          f"tokens, {len(manifest.shards)} shards, {nbytes / 1e6:.1f} MB, {secs:.1f}s -> {out}")


def dry_run(cfg: PrecomputeConfig, result: LoadResult, rank: int) -> None:
    """Token and byte counts from the tokenizer and the architecture alone (no weights)."""
    from inference_eval.engine.target import load_tokenizer

    tok = load_tokenizer(cfg.target)
    if tok is None:
        raise ValueError(f"target {cfg.target.name!r} has no tokenizer; precompute needs one")
    arch = target_arch(cfg)
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


def target_arch(cfg: PrecomputeConfig):
    """The target's ModelArch from its config alone (no weights loaded)."""
    from inference_eval.engine.model.arch import ModelArch

    if cfg.target.source == "random":
        return ModelArch(**cfg.target.arch)
    from transformers import AutoConfig

    from inference_eval.engine.target import target_hf_dir

    return ModelArch.from_hf_config(AutoConfig.from_pretrained(target_hf_dir(cfg.target)))
