"""`torchrun --nproc_per_node 2 -m precompute` (CPU, gloo) writes the same files as one process:
rank r takes shards k % 2 == r of the one global plan, rank 0 writes the manifest."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_torchrun_two_ranks_write_the_single_process_bytes(tmp_path, job_argv, job_env,
                                                          reference_run, same_output):
    out = tmp_path / "shards"
    job = job_argv(out)[3:]  # drop `python -m precompute`
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "-m", "precompute", *job]
    # job_env gives each rank one thread, as the single-process reference had: OpenBLAS's
    # results depend on its thread count, so only equal settings can be compared bytewise.
    proc = subprocess.run(argv, cwd=REPO, env=job_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("precompute done") == 1  # rank 0 alone reports and writes manifest
    same_output(out, reference_run)
    assert (out / "manifest.json").read_text() == (reference_run / "manifest.json").read_text()
