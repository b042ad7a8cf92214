"""`torchrun --nproc_per_node 2 -m inference_eval.generate ... engine.tensor_parallel=2` writes
what one process writes (greedy, the tiny random target with SmolLM2's tokenizer); without
torchrun the same command stops with one line naming the fix."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tp_ranks import free_port

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
ENV.pop("HYDRA_FULL_ERROR", None)
ARGS = ["-m", "inference_eval.generate", "target=tiny", "engine.num_pages=64", "chat=false",
        "sampling.max_new_tokens=6", "sampling.ignore_eos=true"]
PROMPTS = ["The cache holds", "Two ranks", "A longer prompt about tensor parallelism"]


def _args(tmp_path: Path) -> list[str]:
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(PROMPTS) + "\n")
    return [*ARGS, f"prompts_file={f}"]


def _run(argv, tmp_path: Path, name: str) -> list[dict]:
    out = tmp_path / f"{name}.jsonl"
    proc = subprocess.run([sys.executable, *argv, f"output={out}"], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_generate_under_torchrun_equals_one_process(tmp_path):
    args = _args(tmp_path)
    one = _run(args, tmp_path, "one")
    two = _run(["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                "127.0.0.1", "--master_port", str(free_port()), *args,
                "engine.tensor_parallel=2"], tmp_path, "two")
    assert [r["token_ids"] for r in two] == [r["token_ids"] for r in one]
    assert [r["text"] for r in two] == [r["text"] for r in one]


def test_generate_with_tp_but_no_torchrun_is_one_line(tmp_path):
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, *_args(tmp_path), "engine.tensor_parallel=2"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: engine.tensor_parallel=2 needs one process per rank from "
                           "torchrun"), line


def test_generate_at_tp2_x_dp2_equals_one_process(tmp_path):
    """4 ranks, 2 replicas of 2: each replica generates every other prompt; rank 0 writes all
    results in prompt order with their global ids."""
    args = _args(tmp_path)
    one = _run(args, tmp_path, "one")
    four = _run(["-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_addr",
                 "127.0.0.1", "--master_port", str(free_port()), *args,
                 "engine.tensor_parallel=2"], tmp_path, "four")
    assert [r["id"] for r in four] == list(range(len(PROMPTS)))
    assert [r["token_ids"] for r in four] == [r["token_ids"] for r in one]
    assert [r["prompt_ids"] for r in four] == [r["prompt_ids"] for r in one]
