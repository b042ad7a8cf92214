"""Training shards written by the distill stage in the same pass as the answers (shards_dir).

One batch of prompts (the distill ledger's fixed batches) gives one group of shards: the
records of its kept conversations with the states the engine captured while answering
(precompute/capture.py), cut into files of at most shard_tokens tokens,
`shard_<batch>_<part>.safetensors`, each with its sha256 in the manifest like precompute's.
Batch b is its index among every rank's fixed batches sorted by first prompt, so a directory
holds the records in prompt order for one process, and the same files for any rerun.

Resume: after a batch's answers are logged (ledger.py), its shards are written (atomic
renames), then one line `{"plan_hash", "batch", "entries", "rejects"}` goes to this rank's
`.shards.rank<r>.jsonl` (SIGKILL-safe, store.py). A batch without that line is answered
again in full on resume (the same requests, so the same answers and bytes) and its shards
rewritten; its answers are not logged twice. Rank 0 writes `manifest.json` (precompute's
Manifest) once every batch has its line, and removes the logs.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from precompute.capture import CapturedRecord, captured_shard, split_by_tokens
from precompute.distill.store import JsonlLog
from precompute.manifest import Manifest, ShardEntry
from precompute.resume import read_plan_file
from precompute.shard_io import write_shard


def shard_file(batch: int, part: int) -> str:
    return f"shard_{batch:05d}_{part:03d}.safetensors"


def global_batches(num_prompts: int, world: int, batch_size: int) -> list[int]:
    """First prompt index of every rank's fixed batches, sorted: batch b starts at [b]."""
    firsts = []
    for r in range(world):
        mine = list(range(r, num_prompts, world))
        firsts += [mine[j] for j in range(0, len(mine), batch_size)]
    return sorted(firsts)


class CapturedShards:
    """`open` -> `pending` -> `write` per batch -> rank 0 `finish`."""

    def __init__(self, out: Path, plan_hash: str, firsts: Sequence[int], rank: int,
                 hidden_dtype: str, shard_tokens: int) -> None:
        self.out, self.plan_hash, self.rank = out, plan_hash, rank
        self.index = {f: b for b, f in enumerate(firsts)}
        self.hidden_dtype, self.shard_tokens = hidden_dtype, shard_tokens
        self.log = JsonlLog(out / f".shards.rank{rank}.jsonl")
        self.done: dict[int, dict] = {}

    def open(self, overwrite: bool) -> Manifest | None:
        """Prepare the directory; the manifest when this plan is complete there."""
        self.out.mkdir(parents=True, exist_ok=True)
        if overwrite and self.rank == 0:
            for p in list(self.out.glob("shard_*.safetensors")) + list(
                    self.out.glob(".shards.rank*.jsonl")) + [self.out / "manifest.json"]:
                p.unlink(missing_ok=True)
        d = read_plan_file(self.out / "manifest.json", self.plan_hash)
        if d is not None and d.get("complete"):
            m = Manifest.load(self.out / "manifest.json")
            if all((self.out / e.file).is_file() for e in m.shards):
                return m
        self.log.read(repair=True)
        self.done = self._logged()
        return None

    def _from_manifest(self) -> list[dict]:
        """Log rows of the batches a complete manifest lists (a resume after a shard file
        was lost: only the batches missing a file run again)."""
        d = read_plan_file(self.out / "manifest.json", self.plan_hash)
        if d is None:
            return []
        rows = {b: {"plan_hash": self.plan_hash, "batch": b, "entries": [], "rejects": []}
                for b in range(len(self.index))}
        for e in d.get("shards", []):
            rows[e["index"]]["entries"].append(e)
        for r in d.get("data", {}).get("capture_rejects", []):
            rows[r["batch"]]["rejects"].append({k: r[k] for k in ("id", "reason", "detail")})
        return list(rows.values())

    def _logged(self) -> dict[int, dict]:
        rows = self._from_manifest() + [r for p in sorted(self.out.glob(".shards.rank*.jsonl"))
                                        for r in JsonlLog(p).read()]
        for r in rows:
            if r["plan_hash"] != self.plan_hash:
                raise ValueError(f"{self.out} holds shards of another plan (other prompts, "
                                 "target, sampling or shard settings); use a new shards_dir or "
                                 "overwrite=true")
        return {r["batch"]: r for r in rows
                if all((self.out / e["file"]).is_file() for e in r["entries"])}

    def pending(self, first: int) -> bool:
        return self.index[first] not in self.done

    def write(self, first: int, records: Sequence[CapturedRecord], rejects: list[dict]) -> None:
        """The batch starting at prompt `first`: its shard files, then its log line."""
        b = self.index[first]
        entries = []
        for part, group in enumerate(split_by_tokens(records, self.shard_tokens)):
            shard = captured_shard(group, self.hidden_dtype)
            name = shard_file(b, part)
            digest = write_shard(self.out / name, shard)
            entries.append(asdict(ShardEntry(
                file=name, sha256=digest, sequences=len(group), tokens=int(shard.cu_seqlens[-1]),
                loss_tokens=int(shard.loss_mask.sum()), index=b)))
        row = {"plan_hash": self.plan_hash, "batch": b, "entries": entries, "rejects": rejects}
        self.log.append([row])
        self.done[b] = row

    def finish(self, manifest: Manifest) -> Manifest:
        """Rank 0, every rank done: manifest.json with every shard; record rejects counted
        into manifest.data["load_report"]; logs removed."""
        done = self._logged()
        missing = [b for b in range(len(self.index)) if b not in done]
        if missing:
            raise RuntimeError(f"batches {missing[:5]} have no shards after the run; rerun to "
                               "resume")
        manifest.shards = [ShardEntry(**e) for b in sorted(done) for e in done[b]["entries"]]
        manifest.num_planned_shards = len(manifest.shards)
        report = manifest.data.setdefault("load_report", {})
        rejected = dict(report.get("rejected", {}))
        manifest.data["capture_rejects"] = [{"batch": b, **r} for b in sorted(done)
                                            for r in done[b]["rejects"]]
        for r in manifest.data["capture_rejects"]:
            rejected[r["reason"]] = rejected.get(r["reason"], 0) + 1
        report["rejected"] = dict(sorted(rejected.items()))
        report["kept"] = sum(e.sequences for e in manifest.shards)
        manifest.complete = True
        manifest.save(self.out / "manifest.json")
        for p in self.out.glob(".shards.rank*.jsonl"):
            p.unlink()
        return manifest
