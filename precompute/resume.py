"""Resume bookkeeping of a shard directory: which shards of a plan are done, and by whom.

Files in `output_dir` besides the shards:
- `.progress.rank<r>.json`: {"plan_hash", "shards": [ShardEntry]} of rank r, rewritten
  atomically after each shard's own atomic rename, so a kill loses at most the shard in flight;
- `manifest.json`: written by rank 0 once every planned shard is on disk (`complete` true),
  after which the progress files and any `.*.tmp` left by a kill are removed.

Every file carries the plan hash (precompute/identity.py); one written for another plan is
refused, naming `overwrite=true`, so a directory never mixes shards of two plans.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Iterable

from precompute.data import Rejected, write_rejects
from precompute.distributed import barrier
from precompute.manifest import Manifest, ShardEntry, write_json_atomic


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.safetensors"


class ShardLedger:
    """The shards of one plan in `out` that this rank must write and has written.

    Rank r owns shards k with k % world == r of the global plan, so the files are the same as
    one process writes. `open` -> `todo` -> `record` per shard -> `wait_for_all` -> rank 0
    `finish`. group: the process group of the barriers (None: every rank; under tensor
    parallelism the replicas' leaders, precompute/tensor_parallel.py).
    """

    def __init__(self, out: Path, plan_hash: str, num_shards: int, rank: int, world: int,
                 group=None):
        self.out, self.plan_hash, self.num_shards = out, plan_hash, num_shards
        self.rank, self.world, self.group = rank, world, group
        self.progress_path = out / f".progress.rank{rank}.json"
        self.entries: list[ShardEntry] = []  # this rank's finished shards

    def open(self, overwrite: bool) -> Manifest | None:
        """Prepare `out`; returns the manifest when this plan is already complete there."""
        self.out.mkdir(parents=True, exist_ok=True)
        if overwrite and self.rank == 0:
            clear(self.out, with_results=True)
        if overwrite and self.world > 1:
            barrier(self.group)
        finished = finished_manifest(self.out, self.plan_hash, self.num_shards)
        if finished is not None and self.rank == 0:
            print(f"precompute: {self.out} already holds all {self.num_shards} shards of this "
                  "plan; nothing to do (overwrite=true recomputes)")
        done = done_entries(self.out, self.plan_hash)
        mine = self.mine()
        self.entries = [done[k] for k in mine if k in done]
        self._done = set(done)
        return finished

    def mine(self) -> list[int]:
        return [k for k in range(self.num_shards) if k % self.world == self.rank]

    def todo(self) -> list[int]:
        """This rank's shards not yet on disk, in plan order."""
        return [k for k in self.mine() if k not in self._done]

    def record(self, entry: ShardEntry) -> None:
        """A shard was renamed into place: note it in this rank's progress file."""
        self.entries.append(entry)
        self.save()

    def save(self) -> None:
        write_json_atomic(self.progress_path, {"plan_hash": self.plan_hash,
                                               "shards": [asdict(e) for e in self.entries]})

    def wait_for_all(self) -> None:
        """Every rank has written its shards (a barrier under torchrun)."""
        if self.world > 1:
            barrier(self.group)

    def finish(self, manifest: Manifest, rejected: Iterable[Rejected]) -> None:
        """Rank 0, once every rank is done: merged manifest, rejects.jsonl, progress files
        gone."""
        merged = done_entries(self.out, manifest.plan_hash)
        missing = [k for k in range(manifest.num_planned_shards) if k not in merged]
        if missing:
            raise RuntimeError(f"shards {missing[:5]} are missing after the run; rerun to resume")
        manifest.shards = [merged[k] for k in sorted(merged)]
        manifest.complete = True
        manifest.save(self.out / "manifest.json")
        write_rejects(self.out / "rejects.jsonl", rejected)
        clear(self.out, with_results=False)


def read_plan_file(p: Path, expected_hash: str) -> dict | None:
    """The JSON of a manifest or progress file of this plan; None when absent."""
    if not p.is_file():
        return None
    d = json.loads(p.read_text())
    if d.get("plan_hash") != expected_hash:
        raise ValueError(
            f"{p} was written for a different plan (other data, target or settings); use a "
            f"new output_dir or overwrite=true")
    return d


def finished_manifest(out: Path, expected_hash: str, num_shards: int) -> Manifest | None:
    """The manifest of a completed run of this plan whose shard files are all present."""
    d = read_plan_file(out / "manifest.json", expected_hash)
    if d is None or not d.get("complete"):
        return None
    m = Manifest.load(out / "manifest.json")
    if len(m.shards) != num_shards or not all((out / e.file).is_file() for e in m.shards):
        return None
    return m


def done_entries(out: Path, expected_hash: str) -> dict[int, ShardEntry]:
    """Shards already complete on disk for this plan (from manifest and progress files)."""
    entries: dict[int, ShardEntry] = {}
    for p in [out / "manifest.json"] + sorted(out.glob(".progress.rank*.json")):
        d = read_plan_file(p, expected_hash)
        for s in (d or {}).get("shards", []):
            e = ShardEntry(**s)
            f = out / e.file
            if f.is_file() and f.stat().st_size > 0:
                entries[e.index] = e
    return entries


def clear(out: Path, with_results: bool) -> None:
    """Remove progress files and temp files a kill left behind; with_results also the shards,
    the manifest and rejects.jsonl (overwrite=true)."""
    doomed = list(out.glob(".progress.rank*.json")) + list(out.glob(".*.tmp"))
    if with_results:
        doomed += list(out.glob("shard_*.safetensors")) + [out / "manifest.json",
                                                          out / "rejects.jsonl"]
    for p in doomed:
        p.unlink(missing_ok=True)
