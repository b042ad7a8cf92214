"""`distill_manifest.json`: what a distill output_dir holds and how it was made.

Written once, atomically, when every prompt has been answered or rejected (`complete` true):
target identity (name, weights hash), tokenizer and chat-template hashes, sampling settings,
turns mode, data source with the loader's report, counts of kept, truncated and rejected
records by reason, answers and tokens generated. While a run is in flight `.distill_plan.json`
holds the plan hash alone, so a resume with other settings is refused before it mixes answers.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from precompute.data import Conversation
from precompute.distill.store import CONVERSATIONS
from precompute.manifest import write_json_atomic
from precompute.plan import plan_hash

FORMAT_VERSION = 1
MANIFEST = "distill_manifest.json"
PLAN_FILE = ".distill_plan.json"


@dataclass
class DistillManifest:
    plan_hash: str
    target: dict[str, Any]
    tokenizer: dict[str, Any]
    sampling: dict[str, Any]
    turns: str
    data: dict[str, Any]
    num_prompts: int
    # kept, truncated, answers, rejected {reason: n} (the loader's and the stage's)
    counts: dict[str, Any] = field(default_factory=dict)
    generated_tokens: int = 0
    batch_size: int = 0
    world_size: int = 1
    complete: bool = False
    format_version: int = FORMAT_VERSION

    def save(self, path: Path) -> None:
        write_json_atomic(path, asdict(self))

    @classmethod
    def load(cls, path: Path) -> "DistillManifest":
        if not path.is_file():
            raise FileNotFoundError(f"no {MANIFEST} at {path}: is this a distill output_dir?")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc.msg}); rerun the distill stage "
                             "with overwrite=true") from None
        if d.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: format_version {d.get('format_version')} is not "
                             f"{FORMAT_VERSION}; rerun the distill stage with overwrite=true")
        return cls(**d)


def prompts_sha256(prompts: Sequence[Conversation]) -> str:
    """Digest of every prompt's id and turns: other prompts are another plan."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.id, p.to_messages()], ensure_ascii=False).encode() + b"\0")
    return h.hexdigest()


def distill_plan_hash(target_identity: dict[str, Any], tok_id: dict, sampling: dict,
                      turns: str, seed: int, dtype: str,
                      prompts: Sequence[Conversation]) -> str:
    """sha256 of everything that decides the answers. The batch size and the number of
    ranks are left out: they regroup the same requests, so a resume may change them."""
    return plan_hash({"target": target_identity["weights_sha256"], "tok": tok_id,
                      "sampling": sampling, "turns": turns, "seed": seed, "dtype": dtype,
                      "prompts": prompts_sha256(prompts)})


def check_plan(out: Path, expected_hash: str) -> DistillManifest | None:
    """The complete manifest of this plan in `out`, None if there is none yet; raises when
    `out` holds another plan's answers."""
    for name in (MANIFEST, PLAN_FILE):
        p = out / name
        if p.is_file() and json.loads(p.read_text()).get("plan_hash") != expected_hash:
            raise ValueError(
                f"{p} was written for a different plan (other prompts, target or sampling "
                "settings); use a new output_dir or overwrite=true")
    p = out / MANIFEST
    if p.is_file() and (out / CONVERSATIONS).is_file():
        m = DistillManifest.load(p)
        if m.complete:
            return m
    return None


def write_plan_file(out: Path, expected_hash: str) -> None:
    write_json_atomic(out / PLAN_FILE, {"plan_hash": expected_hash})
