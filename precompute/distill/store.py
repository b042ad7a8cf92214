"""Append-only JSONL logs that survive SIGKILL, and the merge that ends a distill run.

A batch's lines go out in one write, then flush + fsync, so after a kill the file holds whole
batches and at most one partially written last line. `JsonlLog.read` skips that line (and
its writer cuts it off the file, so the next append starts on a fresh line); every complete line is kept
and is never produced again. A complete line that does not parse is corruption, not a kill:
that raises naming the file and line.

Files of a distill output_dir:
- `conversations.jsonl`: the answers, one `{"id", "messages", "truncated", "source",
  "generated_tokens"}` per line; one process appends to it batch by batch, and the final
  merge rewrites it in prompt order;
- `.conversations.rank<r>.jsonl`: rank r's answers under torchrun, merged by rank 0 at the end;
- `.rejects.rank<r>.jsonl`: prompts rank r answered but dropped ("empty_answer", ...), kept
  so a resume does not ask them again; merged into `rejects.jsonl` with the load's rejects.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence

CONVERSATIONS = "conversations.jsonl"


def conversations_part(rank: int) -> str:
    return f".conversations.rank{rank}.jsonl"


def rejects_part(rank: int) -> str:
    return f".rejects.rank{rank}.jsonl"


class JsonlLog:
    """One append-only JSONL file of dicts, each carrying an "id"."""

    def __init__(self, path: Path):
        self.path = path

    def read(self, repair: bool = False) -> list[dict]:
        """Every complete line. A partial last line (a kill mid-write) is skipped, and with
        `repair` (only by the process that appends to this file) cut off the file."""
        if not self.path.is_file():
            return []
        raw = self.path.read_bytes()
        good = raw.rfind(b"\n") + 1  # bytes after the last newline: a line cut by a kill
        rows = []
        for lineno, line in enumerate(raw[:good].splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{self.path}:{lineno} is not valid JSON ({exc.msg}) although "
                                 "it is complete: the file is corrupt; rerun with "
                                 "overwrite=true") from None
            rows.append(row)
        if repair and good < len(raw):
            os.truncate(self.path, good)
        return rows

    def append(self, rows: Sequence[dict]) -> None:
        """All rows in one write, then flush and fsync: on disk whole or (nearly) not at all."""
        if not rows:
            return
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def read_all(out: Path, kind: str) -> list[dict]:
    """Rows of every log of `kind` ("conversations" or "rejects") in out, merged file first;
    partial last lines are skipped, never cut (another rank may be appending)."""
    names = [CONVERSATIONS] if kind == "conversations" else []
    names += sorted(p.name for p in out.glob(f".{kind}.rank*.jsonl"))
    return [row for name in names for row in JsonlLog(out / name).read()]


def write_jsonl_atomic(path: Path, rows: Iterable[dict]) -> None:
    """Replace `path` with `rows` (temp file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def in_order(rows: Iterable[dict], order: dict[str, int]) -> list[dict]:
    """One row per id, in prompt order (`order`: id -> index); ids not planned are dropped."""
    by_id = {r["id"]: r for r in rows if r["id"] in order}
    return sorted(by_id.values(), key=lambda r: order[r["id"]])


def clear_parts(out: Path, with_results: bool) -> None:
    """Remove rank logs, the plan file and temp files; with_results also the outputs
    (overwrite=true)."""
    doomed = list(out.glob(".conversations.rank*.jsonl")) + list(out.glob(".rejects.rank*.jsonl"))
    doomed += list(out.glob(".*.tmp")) + [out / ".distill_plan.json"]
    if with_results:
        doomed += [out / CONVERSATIONS, out / "rejects.jsonl", out / "distill_manifest.json"]
    for p in doomed:
        p.unlink(missing_ok=True)
