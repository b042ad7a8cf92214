"""Shared by the self-distillation tests (test_distill*.py): the tiny chat target (its own
lm_head, every 11th token id an end-of-sequence token, so some answers end by themselves and
others are cut at max_new_tokens), the stage's config and argv, output readers, and targets
built once per module. Test modules import the fixtures so they apply there."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import precompute.distill.run as distill_run
import precompute.run as precompute_run
from inference_eval.engine.target import load_target
from inference_eval.hydra_app import CONF_DIR, compose
from precompute.distill import DistillConfig

REPO = Path(__file__).resolve().parents[2]
# One BLAS/OpenMP thread per process, as in the precompute job tests (conftest.JOB_ENV).
JOB_ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

IM_END = 2  # SmolLM2's <|im_end|>
TINY: list[str] = []  # the overrides selecting that target; filled by `chat_target`
STAGE = ["data=jsonl", "engine.max_batch_size=4", "sampling.max_new_tokens=12", "progress=false"]


@pytest.fixture(scope="module", autouse=True)
def chat_target(tmp_path_factory):
    """conf/target/tiny.yaml as `tiny_chat` with that lm_head and those end tokens, in a config
    dir of its own on Hydra's search path (4,469 ids parse in ms from YAML, in seconds as an
    override)."""
    conf = tmp_path_factory.mktemp("conf")
    node = yaml.safe_load((CONF_DIR / "target" / "tiny.yaml").read_text())
    node["name"] = "tiny_chat"
    node["arch"].update(tie_word_embeddings=False, eos_token_ids=list(range(0, 49152, 11)))
    (conf / "target").mkdir()
    (conf / "target" / "tiny_chat.yaml").write_text(yaml.safe_dump(node))
    TINY[:] = [f"hydra.searchpath=[file://{conf}]", "target=tiny_chat"]


def distill_argv(data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "precompute.distill", *TINY, *STAGE, f"data.path={data}",
            f"output_dir={out}", *extra]


def distill_cfg(data: Path, out: Path, *extra: str) -> DistillConfig:
    return compose("distill", DistillConfig, [*TINY, *STAGE, f"data.path={data}",
                                              f"output_dir={out}", *extra])


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def snapshot(out: Path) -> dict[str, tuple[int, bytes]]:
    return {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(out.iterdir())
            if p.is_file()}


def no_generation(*_a, **_k):
    raise AssertionError("nothing should be generated here")


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=REPO, env=JOB_ENV, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(autouse=True)
def shared_targets(monkeypatch):
    """Each random target built once per module: in-process runs skip 3 s of init each."""
    for module in (distill_run, precompute_run):
        monkeypatch.setattr(module, "load_target", _cached_load_target)


_TARGETS: dict[str, object] = {}


def _cached_load_target(cfg, **kwargs):
    key = repr((cfg, sorted(kwargs.items())))
    if key not in _TARGETS:
        _TARGETS[key] = load_target(cfg, **kwargs)
    return _TARGETS[key]
