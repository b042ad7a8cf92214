"""Shared pieces of the precompute job tests: a synthetic chat file, the CLI command line, and
one uninterrupted reference run that the crash and distributed tests compare against."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORDS = ("the draft head reads hidden states of the target model and proposes tokens that the "
         "target verifies in one pass so decoding runs faster without changing its output").split()
# Small shards so a run makes ~20 files: kills land between shards, and both torchrun ranks
# get several.
# One BLAS/OpenMP thread per process everywhere: OpenBLAS's sums depend on its thread count, so
# bytes compare only between runs with the same setting, and torchrun's ranks get one each.
JOB_ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
JOB_ARGS = ["target=tiny", "data=jsonl", "shard_tokens=1024", "batch_tokens=1024",
            "progress=false"]


def write_chats(path: Path, n: int = 30, seed: int = 0) -> Path:
    """n ShareGPT-style conversations of 1-3 exchanges, ~100-1500 tokens each."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            turns = []
            for _ in range(rng.randint(1, 3)):
                for role, lo, hi in (("human", 5, 60), ("gpt", 20, 400)):
                    text = " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))
                    turns.append({"from": role, "value": text})
            f.write(json.dumps({"id": f"chat{i}", "conversations": turns}) + "\n")
    return path


@pytest.fixture(scope="session")
def chats(tmp_path_factory) -> Path:
    return write_chats(tmp_path_factory.mktemp("chats") / "chats.jsonl")


@pytest.fixture(scope="session")
def job_argv(chats):
    """argv of `python -m precompute` for the shared test job writing to `out`."""

    def argv(out: Path, *extra: str) -> list[str]:
        return [sys.executable, "-m", "precompute", *JOB_ARGS, f"data.path={chats}",
                f"output_dir={out}", *extra]

    return argv


@pytest.fixture(scope="session")
def job_env() -> dict[str, str]:
    return dict(JOB_ENV)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, job_argv, job_env) -> Path:
    """Output dir of one uninterrupted single-process run of the shared job."""
    out = tmp_path_factory.mktemp("reference")
    proc = subprocess.run(job_argv(out), cwd=REPO, env=job_env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def shard_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.glob("shard_*.safetensors"))}


def manifest_shards(out: Path) -> list[dict]:
    return json.loads((out / "manifest.json").read_text())["shards"]


@pytest.fixture
def same_output():
    """Assert two output dirs hold byte-identical shards and equal manifest shard rows."""

    def check(got: Path, want: Path) -> None:
        a, b = shard_files(got), shard_files(want)
        assert sorted(a) == sorted(b)
        differing = [name for name in a if a[name] != b[name]]
        assert not differing, f"shards differ in bytes: {differing}"
        assert manifest_shards(got) == manifest_shards(want)
        leftovers = [p.name for p in got.iterdir() if p.name.startswith(".")]
        assert not leftovers, f"temp/progress files left behind: {leftovers}"

    return check
