"""A run killed with SIGKILL and started again continues exactly where the uninterrupted run
would be: same per-step losses and learning rates, same final weights."""
from __future__ import annotations

import time

import torch
from safetensors.torch import load_file

STEPS = 60


def test_resume_after_kill_matches_uninterrupted_run(shards, common, run_train, start_train,
                                                     metrics, tmp_path):
    args = [*common, f"data.shards={shards}", f"trainer.max_steps={STEPS}",
            "trainer.save_every=4"]
    ref, out = tmp_path / "ref", tmp_path / "killed"
    done = run_train(*args, f"output_dir={ref}")
    assert done.returncode == 0, done.stderr[-3000:]

    # Kill as soon as the first checkpoint is complete (`latest` is renamed into place last).
    proc = start_train(*args, f"output_dir={out}", log=tmp_path / "killed.log")
    latest = out / "checkpoints" / "latest"
    deadline = time.monotonic() + 120
    while not latest.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    assert proc.returncode == -9, (tmp_path / "killed.log").read_text()[-3000:]
    assert not (out / "model.safetensors").exists(), "the run finished before the kill"
    killed_steps = [m["step"] for m in metrics(out)]
    assert 4 <= max(killed_steps) < STEPS

    resumed = run_train(*args, f"output_dir={out}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout + resumed.stderr

    want = {m["step"]: m for m in metrics(ref)}
    got = metrics(out)  # killed run's lines, then the resumed run's (steps after the checkpoint
    # may appear twice: logged before the kill and again after the resume; both must match)
    assert {m["step"] for m in got} == set(want)
    assert [m["step"] for m in got[len(killed_steps):]][0] > 1  # resumed, not restarted
    for m in got:
        w = want[m["step"]]
        assert m["loss"] == w["loss"], (m["step"], m["loss"], w["loss"])
        assert m["lr"] == w["lr"]
        assert m["top1_acc"] == w["top1_acc"]
    a, b = load_file(str(ref / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
