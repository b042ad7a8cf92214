"""FSDP checkpoints hold the full head and optimizer, and resume exactly.

Two gloo ranks on CPU under torchrun run the real trainer (`python -m train`,
trainer.strategy=fsdp) with accelerate's own FSDP1 preparation, accumulation and clipping,
and the trainer's checkpoint code; tests/train/fsdp_cpu.py only makes accelerate shard on CPU
ranks as it does on CUDA ones. Rank r takes global micro-batches r, r+2, ... (train/data.py),
so one process with optim.grad_accum=2 sees the same two micro-batches per step: its
checkpoints and losses are the reference for the gathered ones, and it can resume an FSDP
checkpoint (world size 2 -> 1, same global batch).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

STEPS, CUT = 6, 3


def _tensors(path):
    return {k: v for k, v in load_file(str(path)).items() if not k.startswith("rng.")}


def _interrupted_at(done, out, step):
    """`out` as a run of `done`'s arguments leaves it when killed right after step `step`'s
    checkpoint: that checkpoint as `latest`, the metric lines up to it, no final head."""
    name = f"step_{step:08d}"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(done / "checkpoints" / name, out / "checkpoints" / name)
    (out / "checkpoints" / "latest").write_text(name)
    lines = (done / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(x for x in lines if json.loads(x)["step"] <= step))
    return out


def test_fsdp_checkpoint_is_full_and_resumes_on_two_and_one_ranks(shards, common, run_train,
                                                                   run_fsdp, metrics, tmp_path):
    args = [*common, f"data.shards={shards}", f"trainer.max_steps={STEPS}",
            f"trainer.save_every={CUT}"]
    ref, one = tmp_path / "fsdp", tmp_path / "one"
    r = run_fsdp(*args, f"output_dir={ref}")
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train(*args, f"output_dir={one}", "optim.grad_accum=2")
    assert r.returncode == 0, r.stderr[-3000:]

    # Gathered: every trainable weight at its full shape, equal to the unsharded run's.
    for step in (f"step_{CUT:08d}", f"step_{STEPS:08d}"):
        got = load_file(str(ref / "checkpoints" / step / "head" / "model.safetensors"))
        want = load_file(str(one / "checkpoints" / step / "head" / "model.safetensors"))
        assert got.keys() == want.keys() and len(got) > 3
        for k in want:
            assert got[k].shape == want[k].shape, k
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6)
        got = _tensors(ref / "checkpoints" / step / "optimizer.safetensors")
        want = _tensors(one / "checkpoints" / step / "optimizer.safetensors")
        assert got.keys() == want.keys() and any(k.endswith("/exp_avg_sq") for k in got)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-9)
        meta = json.loads((ref / "checkpoints" / step / "state.json").read_text())
        assert meta["run"]["world_size"] == 2 and meta["data_position"] == 2 * int(step[5:])
        assert meta["run"]["strategy"] == "fsdp"
    torch.testing.assert_close(load_file(str(ref / "model.safetensors")),
                               load_file(str(one / "model.safetensors")), rtol=1e-4, atol=1e-6)
    full = {m["step"]: m for m in metrics(ref)}
    for m in metrics(one):
        assert m["lr"] == full[m["step"]]["lr"]
        assert m["loss"] == pytest.approx(full[m["step"]]["loss"], rel=1e-5)

    # Interrupted after CUT, resumed by two FSDP ranks: the uninterrupted run, exactly.
    cut = _interrupted_at(ref, tmp_path / "cut", CUT)
    single = shutil.copytree(cut, tmp_path / "cut_single")
    r = run_fsdp(*args, f"output_dir={cut}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from {cut / 'checkpoints' / f'step_{CUT:08d}'}" in r.stdout + r.stderr
    got = metrics(cut)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for m in got:
        assert (m["loss"], m["lr"]) == (full[m["step"]]["loss"], full[m["step"]]["lr"]), m["step"]
    a, b = load_file(str(ref / "model.safetensors")), load_file(str(cut / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)

    # The same FSDP checkpoint resumed by one process (world 2 -> 1, grad_accum 1 -> 2).
    r = run_train(*args, f"output_dir={single}", "optim.grad_accum=2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout + r.stderr
    got = metrics(single)
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for m in got[CUT:]:
        assert m["lr"] == full[m["step"]]["lr"]
        assert m["loss"] == pytest.approx(full[m["step"]]["loss"], rel=1e-5)
    assert got[-1]["loss"] != pytest.approx(got[CUT]["loss"], rel=1e-3)  # still training
    b = load_file(str(single / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-6)
