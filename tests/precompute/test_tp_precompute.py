"""`torchrun -m precompute ... engine.tensor_parallel=T` (CPU, gloo, the tiny random target):
world/T replicas of T ranks, each replica's leader writes what data-parallel rank `replica`
writes at T=1 (precompute/tensor_parallel.py).

- T=2 (2 processes) and T=2 x DP=2 (4) give the T=1 shards within bf16 rounding (the fp32
  model at T=2 sums its row-parallel products in another order) and the same manifest rows;
  T=2 x DP=2 gives T=2's bytes (the same batches in each replica).
- SIGKILL of a follower mid-run stops the job (bounded by engine.tp_timeout_s); a rerun
  resumes and gives the bytes of an uninterrupted T=2 run; one more does nothing.
- distill at T=2 writes T=1's conversations (greedy) and, with capture, its shards within
  bf16 rounding.
- a world T does not divide, or T > 1 without torchrun: refused first, one line (exit 2 from
  one process; every rank's under torchrun), no hang.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

import precompute.distill.run as distill_run
import precompute.run as precompute_run
from conftest import write_chats
from distill_helpers import TINY, chat_target  # noqa: F401  (the module's tiny chat target)
from inference_eval.hydra_app import compose
from precompute.config import PrecomputeConfig
from precompute.distill import DistillConfig

REPO = Path(__file__).resolve().parents[2]
# One thread per rank: 4 ranks share 2 cores. No torchrun variables from a caller.
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
ENV.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
ENV.pop("HYDRA_FULL_ERROR", None)
DISTILL = ["data=jsonl", "engine.max_batch_size=4", "sampling.max_new_tokens=12",
           "progress=false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(n: int, module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", module,
            *args]


def run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def tensors(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: load_file(p) for p in sorted(out.glob("shard_*.safetensors"))}


def assert_within_bf16(got: Path, want: Path) -> None:
    """The same files, tensors and record lists; float tensors equal up to one bf16 rounding
    step (2^-7 relative; an fp32 sum in another order may round to the neighbour). The
    manifests are equal but for the shards' sha256 (and a distill run's own directory)."""
    a, b = tensors(got), tensors(want)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for key, x in a[name].items():
            y = b[name][key]
            if x.is_floating_point():
                torch.testing.assert_close(x.float(), y.float(), rtol=2 ** -7, atol=1e-5,
                                           msg=lambda m: f"{name} {key}: {m}")
            else:
                assert torch.equal(x, y), (name, key)
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (got, want))
    for m in (ma, mb):
        m["data"].get("regeneration", {}).pop("distill_dir", None)
        for row in m["shards"]:
            row.pop("sha256")  # the bytes differ within rounding, so do their digests
    assert ma == mb
    leftovers = [p.name for p in got.iterdir() if p.name.startswith(".")]
    assert not leftovers, f"temp/progress files left behind: {leftovers}"


def same_bytes(got: Path, want: Path) -> None:
    names = sorted(p.name for p in want.iterdir())
    assert sorted(p.name for p in got.iterdir()) == names
    differing = [n for n in names if (got / n).read_bytes() != (want / n).read_bytes()]
    assert not differing, f"differ in bytes: {differing}"


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory, job_argv) -> Path:
    """One uninterrupted T=2 run of the shared precompute job (conftest.JOB_ARGS)."""
    out = tmp_path_factory.mktemp("tp2")
    proc = run(torchrun(2, "precompute", *job_argv(out)[3:], "engine.tensor_parallel=2"))
    assert proc.stdout.count("precompute done") == 1  # the leader alone reports
    return out


def test_tp2_and_tp2_x_dp2_equal_tp1_within_bf16(tmp_path, job_argv, reference_run, tp2_run):
    assert_within_bf16(tp2_run, reference_run)
    out = tmp_path / "tp2x2"
    proc = run(torchrun(4, "precompute", *job_argv(out)[3:], "engine.tensor_parallel=2"))
    assert proc.stdout.count("precompute done") == 1  # global rank 0 merges
    same_bytes(out, tp2_run)


def _rank_pid(agent: int, rank: int) -> int | None:
    """The pid of torchrun's worker `rank` (a child of the agent process)."""
    try:
        kids = Path(f"/proc/{agent}/task/{agent}/children").read_text().split()
        for pid in kids:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in env:
                return int(pid)
    except OSError:
        pass
    return None


def test_sigkill_of_a_follower_then_resume_gives_the_uninterrupted_bytes(
        tmp_path, job_argv, tp2_run):
    out = tmp_path / "killed"
    args = [*job_argv(out)[3:], "engine.tensor_parallel=2"]
    log = tmp_path / "killed.log"
    with open(log, "w") as err:  # a session of its own: a failed test stops every rank
        job = subprocess.Popen(torchrun(2, "precompute", *args, "engine.tp_timeout_s=20"),
                               cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=err,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (out / "shard_00002.safetensors").exists():
            assert job.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "no third shard in time"
            time.sleep(0.005)
        follower = _rank_pid(job.pid, 1)
        assert follower is not None
        os.kill(follower, signal.SIGKILL)
        t0 = time.monotonic()
        rc = job.wait(timeout=60)  # the leader stops (gloo: closed peer; torchrun: a failed rank)
        assert rc != 0 and time.monotonic() - t0 < 40, log.read_text()[-2000:]
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    written = len(list(out.glob("shard_*.safetensors")))
    assert 0 < written < len(list(tp2_run.glob("shard_*.safetensors")))
    assert not (out / "manifest.json").exists()
    run(torchrun(2, "precompute", *args))
    same_bytes(out, tp2_run)
    # A rerun of the complete plan has nothing to serve: the follower stops at the gate.
    assert "nothing to do" in run(torchrun(2, "precompute", *args)).stdout
    same_bytes(out, tp2_run)


def test_distill_at_tp2_writes_the_tp1_conversations(tmp_path):
    chats = write_chats(tmp_path / "chats.jsonl", n=12)
    outs = {}
    for t in (1, 2):
        out = tmp_path / f"tp{t}"
        args = [*TINY, *DISTILL, f"data.path={chats}", f"output_dir={out}",
                f"shards_dir={out}_shards", "turns=all"]
        if t == 1:
            run([sys.executable, "-m", "precompute.distill", *args])
        else:
            run(torchrun(2, "precompute.distill", *args, "engine.tensor_parallel=2"))
        outs[t] = out
    same_bytes(outs[2], outs[1])  # conversations, rejects, the manifest (plan hash, counts)
    assert_within_bf16(Path(f"{outs[2]}_shards"), Path(f"{outs[1]}_shards"))


WORLD3 = dict(RANK="0", WORLD_SIZE="3", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
              MASTER_PORT="1")  # torchrun's variables as rank 0 of 3 sees them


@pytest.mark.parametrize("stage", ["precompute", "distill"])
@pytest.mark.parametrize("env,message", [
    (WORLD3, "engine.tensor_parallel=2 does not divide the world size 3: launch a multiple "
             "of 2 processes"),
    ({}, "engine.tensor_parallel=2 needs one process per rank from torchrun"),
])
def test_bad_launches_are_refused_before_any_data_or_group(tmp_path, monkeypatch, stage, env,
                                                           message):
    for var in WORLD3:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    args = ["target=tiny", "data=jsonl", f"data.path={tmp_path / 'none.jsonl'}",
            f"output_dir={tmp_path / 'out'}", "engine.tensor_parallel=2"]
    schema, main = ((PrecomputeConfig, precompute_run.main) if stage == "precompute"
                    else (DistillConfig, distill_run.main))
    with pytest.raises(ValueError, match=message):  # not the missing data file: it is first
        main(compose(stage, schema, args))
    assert not dist.is_initialized()


def test_tp_without_torchrun_is_one_line_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "precompute", "target=tiny", "data=jsonl",
                           f"data.path={tmp_path / 'none.jsonl'}", "engine.tensor_parallel=2"],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: engine.tensor_parallel=2 needs one process per rank from "
                           "torchrun"), line


def test_a_world_of_three_under_torchrun_stops_every_rank(tmp_path, job_argv):
    proc = subprocess.run(torchrun(3, "precompute", *job_argv(tmp_path / "out")[3:],
                                   "engine.tensor_parallel=2"),
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=90)
    assert proc.returncode != 0
    line = "error: engine.tensor_parallel=2 does not divide the world size 3"
    assert proc.stderr.count(line) == 3, proc.stderr[-3000:]  # every rank, one line each
    # The only traceback is torchrun's own report of its failed children.
    assert proc.stderr.count("Traceback") == 1 and "ChildFailedError" in proc.stderr
    assert not (tmp_path / "out").exists()
