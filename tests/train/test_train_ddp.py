"""Two gloo ranks on CPU under torchrun train like one process with the same global batch.

Rank r takes global micro-batches r, r+2, ... of the shared order (train/data.py); one process
with optim.grad_accum=2 takes 0,1 then 2,3: the same two micro-batches per optimizer step. So
the per-step losses, learning rates and final weights must agree up to all-reduce rounding.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

STEPS = 7  # 14 micro-batches: past the first epoch's 11-12, the orders coincide there too


# dflash: a block drafter's random anchors (4 of each sequence's candidates, of which most
# sequences here have more) are drawn from their micro-batch's own seed, so ranks and
# accumulation draw the same blocks.
@pytest.mark.parametrize("head", [[], ["head=dflash", "head.num_steps=3", "head.anchors_per_seq=4"]],
                         ids=["mtp", "dflash"])
def test_two_ranks_match_one_process_with_grad_accum(shards, aux_shards, common, run_train,
                                                     metrics, tmp_path, head):
    data = aux_shards if head else shards
    args = [*common, *head, f"data.shards={data}", f"trainer.max_steps={STEPS}",
            f"trainer.save_every={STEPS}"]
    ddp = run_train(*args, f"output_dir={tmp_path / 'ddp'}", "trainer.strategy=ddp", nproc=2)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    one = run_train(*args, f"output_dir={tmp_path / 'one'}", "optim.grad_accum=2")
    assert one.returncode == 0, one.stderr[-3000:]

    got, want = metrics(tmp_path / "ddp"), metrics(tmp_path / "one")
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        assert g["lr"] == w["lr"]  # one scheduler step per optimizer step, not one per rank
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
    assert want[-1]["loss"] < want[0]["loss"] - 0.05  # it learned: the comparison has teeth
    a = load_file(str(tmp_path / "ddp" / "model.safetensors"))
    b = load_file(str(tmp_path / "one" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
