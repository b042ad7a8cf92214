"""SIGKILL the precompute job at several points; each rerun resumes, and the result is the
same bytes as an uninterrupted run (shards are written under a temporary name and renamed,
so a killed run resumes at the next missing shard: docs/data.md, Precompute)."""
from __future__ import annotations

import subprocess
from pathlib import Path

from kill_point import run_until

REPO = Path(__file__).resolve().parents[2]


def _mapped(pid: int, needle: str) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_sigkill_at_several_points_then_resume_gives_identical_shards(
        tmp_path, job_argv, job_env, reference_run, same_output):
    out = tmp_path / "shards"
    argv = job_argv(out)
    total = len(list(reference_run.glob("shard_*.safetensors")))
    assert total >= 10

    # 1. While the target loads: the tokenizer's native library is mapped once loading began.
    run_until(argv, job_env, lambda pid: _mapped(pid, "tokenizers"))
    assert not list(out.glob("shard_*.safetensors"))

    # 2. As soon as the first shard file appears; 3. on a rerun, when the third one does.
    for name in ("shard_00000.safetensors", "shard_00002.safetensors"):
        run_until(argv, job_env, lambda pid, f=out / name: f.exists())
        written = len(list(out.glob("shard_*.safetensors")))
        assert 0 < written < total, "the kill should land mid-run"
        assert not (out / "manifest.json").exists()
        assert list(out.glob(".progress.rank*.json")) or written == 1

    # 4. A last rerun completes.
    proc = subprocess.run(argv, cwd=REPO, env=job_env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    same_output(out, reference_run)
    assert (out / "manifest.json").read_text() == (reference_run / "manifest.json").read_text()
    assert (out / "rejects.jsonl").read_bytes() == (reference_run / "rejects.jsonl").read_bytes()
