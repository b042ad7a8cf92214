"""`manifest.json`: what a shard directory holds and how it was made (docs/data.md).

Written once, atomically, when every planned shard is on disk (`complete` true). While a run
is in flight each rank records its finished shards in `.progress.rank<r>.json` (same
`ShardEntry` rows), so a kill loses at most the shard in flight and a rerun resumes.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
HIDDEN_CONVENTION = "last_layer_pre_final_norm"


@dataclass
class ShardEntry:
    file: str
    sha256: str
    sequences: int
    tokens: int
    loss_tokens: int
    index: int  # position in the global shard plan


@dataclass
class Manifest:
    target: dict[str, Any]
    tokenizer: dict[str, Any]
    hidden_dtype: str
    hidden_size: int
    aux_layers: list[int]
    plan_hash: str
    num_planned_shards: int
    data: dict[str, Any] = field(default_factory=dict)
    shards: list[ShardEntry] = field(default_factory=list)
    format_version: int = FORMAT_VERSION
    hidden_convention: str = HIDDEN_CONVENTION
    complete: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def done_indices(self) -> set[int]:
        return {s.index for s in self.shards}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shards"] = sorted(d["shards"], key=lambda s: s["index"])
        return d

    def save(self, path: str | Path) -> None:
        write_json_atomic(Path(path), self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "Manifest":
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"no manifest at {p}: is this a precompute output_dir?")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p} is not valid JSON ({exc.msg}); rerun precompute") from None
        if d.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{p}: format_version {d.get('format_version')} is not "
                             f"{FORMAT_VERSION}; re-run precompute with this version")
        d["shards"] = [ShardEntry(**s) for s in d.get("shards", [])]
        return cls(**d)


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
