"""Trainer fixtures: a tiny random target with a 300-token vocabulary (so a step's soft CE is
cheap on CPU), shards written for it directly (no precompute run), and a CLI runner."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference_eval.hydra_app import compose
from inference_eval.engine.target import load_target
from precompute.manifest import Manifest, ShardEntry
from precompute.shard_io import Shard, write_shard
from train.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]
PYTHON = Path(sys.executable)
# conf/target/tiny.yaml with a small vocabulary and no tokenizer (training never needs text).
TARGET = ["target=tiny", "target.name=tiny-v300", "target.tokenizer=null",
          "target.arch.vocab_size=300"]
# Everything a test run shares: no validation/wandb/progress bar, a metric line per step and a
# sharp temperature (the random target's distributions are near-uniform at T=1, which would
# make every loss curve flat and every comparison below insensitive).
COMMON = [*TARGET, "trainer.wandb=disabled", "validation.enabled=false", "trainer.progress=false",
          "trainer.log_every=1", "trainer.device=cpu", "data.batch_tokens=128",
          "optim.lr=3e-3", "optim.warmup_steps=2", "head.distill_temperature=0.1"]


def write_test_shards(out: Path, target_overrides=(), num_shards: int = 2, seqs: int = 30,
                      seed: int = 0, aux_layers: tuple[int, ...] = ()) -> Path:
    """Shards + manifest as precompute writes them, for the composed tiny target: random
    sequences of 8..39 tokens, bf16 hidden states [N, 64] (and, with aux_layers, random aux
    states [N, A, 64] of those layers, as precompute aux=... writes them). Returns `out`."""
    target = compose("train", TrainConfig, [*TARGET, *target_overrides]).target
    identity = load_target(target, with_tokenizer=False).identity
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    entries = []
    for k in range(num_shards):
        lens = torch.randint(8, 40, (seqs,), generator=g)
        n = int(lens.sum())
        shard = Shard(input_ids=torch.randint(0, 300, (n,), generator=g),
                      loss_mask=(torch.rand(n, generator=g) > 0.3).to(torch.uint8),
                      hidden=torch.randn(n, 64, generator=g).bfloat16(),
                      cu_seqlens=torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
                      aux_hidden=torch.randn(n, len(aux_layers), 64, generator=g).bfloat16()
                      if aux_layers else None)
        name = f"shard_{k:05d}.safetensors"
        digest = write_shard(out / name, shard)
        entries.append(ShardEntry(file=name, sha256=digest, sequences=seqs, tokens=n,
                                  loss_tokens=int(shard.loss_mask.sum()), index=k))
    Manifest(target=dict(identity), tokenizer={}, hidden_dtype="bfloat16", hidden_size=64,
             aux_layers=list(aux_layers), plan_hash="test", num_planned_shards=num_shards,
             shards=entries,
             complete=True).save(out / "manifest.json")
    return out


@pytest.fixture(scope="session")
def shards(tmp_path_factory) -> Path:
    """~1.4k tokens in two shards: 11-12 micro-batches of 128 tokens per epoch."""
    return write_test_shards(tmp_path_factory.mktemp("shards") / "s")


@pytest.fixture(scope="session")
def aux_shards(tmp_path_factory) -> Path:
    """The same sequences as `shards`, with aux states of layers 0 and 1 (block drafters)."""
    return write_test_shards(tmp_path_factory.mktemp("aux_shards") / "s", aux_layers=(0, 1))


@pytest.fixture(scope="session")
def make_shards():
    """write_test_shards, for tests that need shards of another target (test modules cannot
    import this conftest: tests/conftest.py shares its module name)."""
    return write_test_shards


@pytest.fixture
def shards_copy(shards, tmp_path) -> Path:
    """A private copy to break."""
    return Path(shutil.copytree(shards, tmp_path / "shards"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env() -> dict:
    # One BLAS thread per process: bitwise-repeatable reductions and no oversubscription when
    # two ranks share the machine.
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled",
            "PYTHONWARNINGS": "ignore::FutureWarning"}


def train_cmd(*overrides: str, nproc: int = 1) -> list[str]:
    if nproc == 1:
        return [str(PYTHON), "-m", "train", *overrides]
    return [str(PYTHON), "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "train",
            *overrides]


@pytest.fixture
def run_train():
    """run_train(*overrides, nproc=1) -> CompletedProcess of `python -m train` (or torchrun)."""

    def run(*overrides: str, nproc: int = 1, timeout: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run(train_cmd(*overrides, nproc=nproc), cwd=REPO, env=cli_env(),
                              capture_output=True, text=True, timeout=timeout)

    return run


@pytest.fixture
def run_fsdp():
    """run_fsdp(*overrides) -> CompletedProcess of `python -m train trainer.strategy=fsdp` on
    two gloo ranks, accelerate sharding on the CPU (tests/train/fsdp_cpu.py)."""

    def run(*overrides: str, timeout: float = 180) -> subprocess.CompletedProcess:
        cmd = [str(PYTHON), "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               str(REPO / "tests" / "train" / "fsdp_cpu.py"), "trainer.strategy=fsdp", *overrides]
        return subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True,
                              timeout=timeout)

    return run


@pytest.fixture
def start_train():
    """start_train(*overrides, log=PATH) -> Popen of `python -m train`, output to `log`;
    killed at teardown if still running."""
    procs = []

    def start(*overrides: str, log: Path) -> subprocess.Popen:
        with open(log, "w") as f:
            proc = subprocess.Popen(train_cmd(*overrides), cwd=REPO, env=cli_env(), stdout=f,
                                    stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def read_metrics(out: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def metrics():
    return read_metrics


@pytest.fixture
def common() -> list[str]:
    """Overrides every trainer test run shares (see COMMON)."""
    return list(COMMON)
