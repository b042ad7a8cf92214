"""Full (unsharded) head weights and optimizer state, whatever wraps the head.

Training checkpoints hold the whole head and its whole AdamW state keyed by parameter name,
so a run saved under one strategy or world size resumes under another (train/state.py
checks that the global batch is unchanged). Per strategy:

  none / ddp  every rank holds everything: the local objects are the full state.
  fsdp        weights and AdamW state are sharded (FSDP1, use_orig_params): gathered with
              FSDP's FULL_STATE_DICT collectives when saving; when loading every rank reads
              the full optimizer state and FSDP keeps its own shard (optim_state_dict_to_load).
  deepspeed   ZeRO-2 replicates the weights but keeps AdamW state in flat fp32 partitions that
              only DeepSpeed maps back to parameters, so the optimizer goes through the
              engine's own checkpoint (save_checkpoint / load_checkpoint on every rank).

Every method that gathers is a collective: all ranks call it, in the same order, and rank 0
gets the result. Calling one on rank 0 alone would hang the job.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

DEEPSPEED_TAG = "zero"


class FullState:
    """model: what acc.prepare returned; optimizer: the optimizer acc.prepare returned (or the
    torch one); module: the head itself (names, config); trainable: the names a head
    checkpoint stores, in one order on every rank; barrier: waits for all ranks."""

    def __init__(self, strategy: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                 module: nn.Module, trainable: list[str], device: torch.device, is_main: bool,
                 barrier: Callable[[], None]) -> None:
        self.strategy, self.model, self.module = strategy, model, module
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # under AcceleratedOptimizer
        self.trainable, self.device, self.is_main = list(trainable), device, is_main
        self.barrier = barrier

    # ---- weights ---------------------------------------------------------------------------
    def head_weights(self) -> dict[str, torch.Tensor] | None:
        """Collective. The trainable weights, full, fp32 (d2t ids stay int) and on the CPU, on
        rank 0; None on the other ranks."""
        if self.strategy == "fsdp":
            with self._fsdp_full_state():
                state = self.model.state_dict()
        else:
            # ZeRO-2 replicates the (bf16) module weights: accelerate's get_state_dict reads them
            # the same way (module.state_dict()) outside ZeRO-3.
            state = self.module.state_dict()
        if not self.is_main:
            return None
        missing = [k for k in self.trainable if k not in state]
        if missing:
            raise RuntimeError(f"gathered state of the {self.strategy} model lacks {missing[:5]}")
        return {k: _to_cpu_fp32(state[k]) for k in self.trainable}

    # ---- optimizer -------------------------------------------------------------------------
    def optimizer_state(self) -> dict | None:
        """Collective. {"state": {name: {key: tensor}}, "param_groups": [{..., "params": [name]}]}
        on rank 0 (None elsewhere); None everywhere under deepspeed (see save_engine)."""
        if self.strategy == "deepspeed":
            return None
        if self.strategy == "fsdp":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            with self._fsdp_full_state():
                osd = FSDP.optim_state_dict(self.model, self.optimizer)
            return osd if self.is_main else None
        if not self.is_main:
            return None
        sd = self.optimizer.state_dict()
        names = self._names_in_optimizer_order()
        return {"state": {names[i]: st for i, st in sd["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                                 for g in sd["param_groups"]]}

    def load_optimizer_state(self, osd: dict) -> None:
        """Every rank, after acc.prepare: `osd` as optimizer_state returned it (full, by name)."""
        if self.strategy == "deepspeed":
            raise RuntimeError("deepspeed restores its optimizer with load_engine")
        names = self._names_in_optimizer_order()
        saved = [n for g in osd["param_groups"] for n in g["params"]]
        if sorted(saved) != sorted(names):
            lost, extra = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
            raise ValueError(f"optimizer state in the checkpoint does not match this head: "
                             f"missing {lost[:5]}, unexpected {extra[:5]}")
        if self.strategy == "fsdp":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            with self._fsdp_full_state(rank0_only=False):
                sd = FSDP.optim_state_dict_to_load(self.model, self.optimizer, osd)
        else:
            index = {n: i for i, n in enumerate(names)}
            sd = {"state": {index[n]: st for n, st in osd["state"].items()},
                  "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                   for g in osd["param_groups"]]}
        self.optimizer.load_state_dict(sd)

    # ---- deepspeed -------------------------------------------------------------------------
    def save_engine(self, path: Path) -> None:
        """Collective, deepspeed only: every rank writes its ZeRO partition under `path`."""
        self.model.save_checkpoint(str(path), tag=DEEPSPEED_TAG)

    def load_engine(self, path: Path) -> None:
        """Every rank, after acc.prepare. DeepSpeed reads its files with torch.load
        (weights_only=False): the one place the trainer unpickles. It only ever reads the
        engine files this trainer wrote into its own output_dir/checkpoints, never a path
        from a config or the hub; heads themselves always travel as safetensors."""
        loaded, _ = self.model.load_checkpoint(str(path), tag=DEEPSPEED_TAG,
                                               load_optimizer_states=True,
                                               load_lr_scheduler_states=False)
        if loaded is None:
            raise FileNotFoundError(f"no DeepSpeed engine checkpoint under {path}")

    # ---- helpers ---------------------------------------------------------------------------
    def _names_in_optimizer_order(self) -> list[str]:
        by_id = {id(p): n for n, p in self.module.named_parameters()}
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        missing = [i for i, p in enumerate(params) if id(p) not in by_id]
        if missing:
            raise RuntimeError(f"optimizer parameters {missing[:5]} are not parameters of the head")
        return [by_id[id(p)] for p in params]

    def _fsdp_full_state(self, rank0_only: bool = True):
        from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import StateDictType

        # offload_to_cpu keeps the gathered head off the GPU (accelerate's get_state_dict does
        # the same); on CPU ranks it is pointless and crashes torch 2.13 (SIGSEGV, measured).
        off = self.device.type != "cpu"
        return FSDP.state_dict_type(
            self.model, StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=off, rank0_only=rank0_only),
            FullOptimStateDictConfig(offload_to_cpu=off, rank0_only=rank0_only))


def _to_cpu_fp32(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    return t.float() if t.is_floating_point() else t
