"""scripts/bench_tp.py end to end on 2 gloo ranks (tiny random target, 2 steps; its figures
are not checked, its counts are): one JSON line, a TP=1 baseline beside it, and exactly one
broadcast, one all-reduce for the embedding and two per layer, one logits gather per step."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_tp_reports_one_json_line_with_its_collectives():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", "scripts/bench_tp.py", "--target", "tiny",
                           "--batches", "1", "--steps", "2", "--prompt-len", "8"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, proc.stdout  # rank 0 alone reports
    out = json.loads(lines[0])
    assert out["bench"] == "tp" and out["tp"] == 2 and out["base_threads"] == 2
    row = out["rows"][0]
    assert row["ours_ms_step"] > 0 and row["base_ms_step"] > 0 and 0 <= row["comm_share"] <= 1
    layers = 4  # bench_tp.RANDOM["tiny"]
    assert row["collectives_per_step"] == {"broadcast": 1.0, "all_reduce": 1.0 + 2 * layers,
                                           "gather": 1.0}
