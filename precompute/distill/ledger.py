"""Resume bookkeeping of a distill output_dir: which prompts are answered, and by whom.

Rank r owns prompts i with i % world == r, in batches of the engine's batch size cut from that
fixed list; a resume answers only the prompts of each batch not yet on disk (in any rank's log
or the merged file), so no answer is generated twice, and a batch that finished before a kill
is not regrouped: the next batches are the same requests as in an uninterrupted run. Rank 0
merges every log into conversations.jsonl and rejects.jsonl at the end (precompute/distill/
store.py), then writes distill_manifest.json (precompute/distill/manifest.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from precompute.data import Conversation, Rejected
from precompute.distill.manifest import (
    MANIFEST,
    DistillManifest,
    check_plan,
    write_plan_file,
)
from precompute.distill.store import (
    CONVERSATIONS,
    JsonlLog,
    clear_parts,
    conversations_part,
    in_order,
    read_all,
    rejects_part,
    write_jsonl_atomic,
)
from precompute.distributed import barrier


class DistillLedger:
    """`open` -> `batches` -> `record` per batch -> `wait_for_all` -> rank 0 `finish`.
    group: the process group of the barriers (None: every rank; the replicas' leaders under
    tensor parallelism)."""

    def __init__(self, out: Path, plan_hash: str, prompts: Sequence[Conversation], rank: int,
                 world: int, group=None):
        self.out, self.plan_hash, self.prompts = out, plan_hash, list(prompts)
        self.rank, self.world, self.group = rank, world, group
        self.order = {p.id: i for i, p in enumerate(self.prompts)}
        # One process appends to the final file itself; ranks keep their own logs.
        live = CONVERSATIONS if world == 1 else conversations_part(rank)
        self.kept_log = JsonlLog(out / live)
        self.reject_log = JsonlLog(out / rejects_part(rank))
        self.done: set[str] = set()

    def open(self, overwrite: bool) -> DistillManifest | None:
        """Prepare `out`; returns the manifest when this plan is already complete there."""
        self.out.mkdir(parents=True, exist_ok=True)
        if overwrite and self.rank == 0:
            clear_parts(self.out, with_results=True)
        if overwrite and self.world > 1:
            barrier(self.group)
        finished = check_plan(self.out, self.plan_hash)
        if finished is not None:
            if self.rank == 0:
                print(f"distill: {self.out} already holds the answers of this plan; nothing to "
                      "do (overwrite=true generates them again)")
            return finished
        if self.rank == 0:
            write_plan_file(self.out, self.plan_hash)
        # This rank's own logs first: a line a kill left half written is cut off before the
        # first append (another rank's logs are only read).
        self.kept_log.read(repair=True)
        self.reject_log.read(repair=True)
        rows = read_all(self.out, "conversations") + read_all(self.out, "rejects")
        self.done = {r["id"] for r in rows if r["id"] in self.order}
        return None

    def mine(self) -> list[int]:
        return [i for i in range(len(self.prompts)) if i % self.world == self.rank]

    def fixed_batches(self, batch_size: int) -> list[tuple[int, list[int]]]:
        """(first prompt index, every prompt index) of each of this rank's fixed batches."""
        mine = self.mine()
        return [(mine[j], mine[j:j + batch_size]) for j in range(0, len(mine), batch_size)]

    def batches(self, batch_size: int) -> list[tuple[int, list[int]]]:
        """(first prompt index of the fixed batch, its prompt indices still to answer) for
        this rank's batches with something left to answer."""
        mine = self.mine()
        cut = [mine[j:j + batch_size] for j in range(0, len(mine), batch_size)]
        todo = [(b[0], [i for i in b if self.prompts[i].id not in self.done]) for b in cut]
        return [(first, b) for first, b in todo if b]

    def record(self, kept: list[dict], rejected: list[dict]) -> None:
        """One batch's outcomes on disk (rejects first: a kill between the two writes only
        loses kept answers, which the resume then asks for again, never twice)."""
        self.reject_log.append(rejected)
        self.kept_log.append(kept)
        self.done.update(r["id"] for r in kept + rejected)

    def wait_for_all(self) -> None:
        if self.world > 1:
            barrier(self.group)

    def finish(self, manifest: DistillManifest, load_rejected: Sequence[Rejected]) -> None:
        """Rank 0, once every rank is done: conversations.jsonl in prompt order, rejects.jsonl
        (the loader's, then the stage's), counts, the manifest; rank logs removed."""
        kept = in_order(read_all(self.out, "conversations"), self.order)
        dropped = in_order(read_all(self.out, "rejects"), self.order)
        missing = len(self.prompts) - len(kept) - len(dropped)
        if missing:
            raise RuntimeError(f"{missing} prompts have no answer after the run; rerun to "
                               "resume")
        write_jsonl_atomic(self.out / CONVERSATIONS, kept)
        write_jsonl_atomic(self.out / "rejects.jsonl",
                           [{"id": r.id, "reason": r.reason, "detail": r.detail}
                            for r in load_rejected]
                           + [{k: r[k] for k in ("id", "reason", "detail")} for r in dropped])
        rejected = dict(manifest.data["load_report"]["rejected"])
        for r in dropped:
            rejected[r["reason"]] = rejected.get(r["reason"], 0) + 1
        answers = sum(m["role"] == "assistant" for r in kept for m in r["messages"])
        manifest.counts = {"kept": len(kept), "truncated": sum(r["truncated"] for r in kept),
                           "answers": answers, "rejected": dict(sorted(rejected.items()))}
        manifest.generated_tokens = sum(r["generated_tokens"] for r in kept + dropped)
        manifest.complete = True
        manifest.save(self.out / MANIFEST)
        clear_parts(self.out, with_results=False)
