"""`python -m train` with accelerate sharding on CPU ranks, for the FSDP test (gloo).

    torchrun --nproc_per_node 2 tests/train/fsdp_cpu.py trainer.strategy=fsdp OVERRIDES...

accelerate hands an FSDP plugin to torch only on accelerators: on CPU ranks it sets up plain
DDP (MULTI_CPU) and drops the plugin, and train/distributed.py then refuses the run. Torch's
FSDP1 itself runs on gloo. So this launcher makes accelerate's state take the branch it takes
on CUDA ranks (distributed type FSDP, the plugin kept) and sets its device to the plain `cpu`
FSDP computes on (accelerate's `cpu:0` does not compare equal to it); everything else, the
trainer's entry point, loop, accelerate's prepare/accumulate/clip and the checkpoint code,
runs unchanged.
"""
from __future__ import annotations

import runpy
import sys

import torch
from accelerate import state
from accelerate.utils import DistributedType

_init = state.AcceleratorState.__init__


def _init_sharding_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.fsdp_plugin = fsdp_plugin
        # Into the process-wide state too, as accelerate's own FSDP branch does: every later
        # AcceleratorState() copies the distributed type back from it.
        for s in (self.__dict__, state.PartialState._shared_state):
            s.update(distributed_type=DistributedType.FSDP, device=torch.device("cpu"))


if __name__ == "__main__":
    state.AcceleratorState.__init__ = _init_sharding_on_cpu
    sys.argv = ["train", *sys.argv[1:]]
    runpy.run_module("train", run_name="__main__", alter_sys=True)
