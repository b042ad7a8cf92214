"""Kill a job at a chosen point: the crash-resume tests of precompute and self-distillation
(imported as a top-level module, like tiny_hf_models)."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_until(argv: list[str], env: dict, ready, timeout: float = 120.0) -> None:
    """Start the job, poll `ready(pid)` every few ms, SIGKILL the job as soon as it holds."""
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + timeout
    try:
        while not ready(proc.pid):
            if proc.poll() is not None:
                raise AssertionError(f"the job ended (rc {proc.returncode}) before the kill point: "
                                     f"{proc.stderr.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                raise AssertionError("kill point not reached in time")
            time.sleep(0.005)
    finally:
        proc.kill()  # SIGKILL: no cleanup handlers run
        proc.wait()
        proc.stderr.close()
