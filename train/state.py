"""Training checkpoints: head weights, optimizer, scheduler, RNG, data position, run shape.

    output_dir/checkpoints/step_00000100/
      head/                  the head checkpoint (heads.checkpoint), full weights even when the
                             training strategy shards them
      optimizer.safetensors  AdamW state by parameter name ("<name>/<key>") and the RNG state
      deepspeed/             DeepSpeed's engine checkpoint (strategy=deepspeed only)
      state.json             step, data position, run shape, scheduler, scalar optimizer state

A checkpoint is written under a temp name and renamed; `latest` is updated last, so a kill
leaves either the previous or the new checkpoint, never a mix. Saving is a collective (the
state is gathered from every rank first, train/full_state.py); rank 0 writes. Nothing is
unpickled on load, except DeepSpeed's own engine files (see FullState.load_engine).

The data position counts global micro-batches (train/data.py), so a resume on another world
size continues from the same sample as long as the global batch, world size x grad_accum
micro-batches of data.batch_tokens, is unchanged; anything else stops with an error.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from heads.checkpoint import save_head
from heads.formats.bundle import read_json, read_safetensors
from train.full_state import FullState

STATE_FORMAT = 2  # 1: optimizer by parameter index, per-rank data position (refused)


@dataclass
class RunShape:
    """What a data position and an optimizer step mean for one run."""

    world_size: int
    grad_accum: int
    batch_tokens: int
    seed: int
    strategy: str

    @property
    def micro_batches_per_step(self) -> int:
        return self.world_size * self.grad_accum


@dataclass
class Resume:
    step: int
    position: int  # global micro-batches consumed
    optimizer: dict | None  # by parameter name (FullState.load_optimizer_state); None: deepspeed
    engine_dir: Path | None  # DeepSpeed's engine checkpoint


class GatheredHead:
    """What heads.checkpoint.save_head reads of a head, with weights gathered from all ranks."""

    def __init__(self, head, weights: dict[str, torch.Tensor]) -> None:
        self.cfg, self.arch, self.target_identity = head.cfg, head.arch, head.target_identity
        self._weights = weights

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return self._weights


def save_final_head(full: FullState, path: Path, extra: dict) -> Path | None:
    """Collective: gather the head and write it as a head checkpoint (rank 0)."""
    weights = full.head_weights()
    out = save_head(GatheredHead(full.module, weights), path, extra=extra) if full.is_main else None
    full.barrier()
    return out


def save_training_state(root: Path, step: int, full: FullState, scheduler, position: int,
                        shape: RunShape, metrics: dict, keep: int = 2) -> Path | None:
    """Collective: every rank calls it. Returns the checkpoint dir on rank 0, else None."""
    from safetensors.torch import save_file

    ck = root / f"step_{step:08d}"
    tmp = root / f".step_{step:08d}.tmp"
    weights = full.head_weights()
    osd = full.optimizer_state()
    if full.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    full.barrier()
    if shape.strategy == "deepspeed":
        full.save_engine(tmp / "deepspeed")
        full.barrier()
    if full.is_main:
        save_head(GatheredHead(full.module, weights), tmp / "head")
        tensors, scalars = _flatten_optimizer(osd)
        tensors["rng.torch"] = torch.get_rng_state()
        if torch.cuda.is_available():
            tensors["rng.cuda"] = torch.cuda.get_rng_state()
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "state.json").write_text(json.dumps({
            "format": STATE_FORMAT, "step": step, "data_position": position,
            "run": asdict(shape), "optimizer": scalars,
            "scheduler": scheduler.state_dict(), "metrics": metrics}, indent=1))
        shutil.rmtree(ck, ignore_errors=True)
        os.replace(tmp, ck)
        (root / ".latest.tmp").write_text(ck.name)
        os.replace(root / ".latest.tmp", root / "latest")
        for old in sorted(root.glob("step_*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    full.barrier()  # every rank returns with the checkpoint complete
    return ck if full.is_main else None


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest` names; when that one is gone (deleted because it was damaged),
    the newest complete step_* directory before it."""
    p = root / "latest"
    if not p.is_file():
        return None
    ck = root / p.read_text().strip()
    if (ck / "state.json").is_file():
        return ck
    older = sorted(d for d in root.glob("step_*") if (d / "state.json").is_file())
    return older[-1] if older else None


def check_resume(ck: Path, saved: RunShape, now: RunShape) -> None:
    """Stop, naming both values, when the checkpoint's data position or optimizer state would
    mean something else in this run."""
    hint = "; or start a new output_dir"
    if saved.batch_tokens != now.batch_tokens or saved.seed != now.seed:
        raise ValueError(f"checkpoint {ck} was trained with data.batch_tokens={saved.batch_tokens}"
                         f" and trainer.seed={saved.seed}, this run has {now.batch_tokens} and "
                         f"{now.seed}: the micro-batches (and so the data position) would differ;"
                         f" resume with the saved values{hint}")
    if saved.micro_batches_per_step != now.micro_batches_per_step:
        fix = ""
        if saved.micro_batches_per_step % now.world_size == 0:
            fix = f"; set optim.grad_accum={saved.micro_batches_per_step // now.world_size} to keep it"
        raise ValueError(f"checkpoint {ck} was trained with a global batch of world size "
                         f"{saved.world_size} x optim.grad_accum {saved.grad_accum} = "
                         f"{saved.micro_batches_per_step} micro-batches per optimizer step; this "
                         f"run has world size {now.world_size} x optim.grad_accum {now.grad_accum}"
                         f" = {now.micro_batches_per_step}{fix}{hint}")
    if (saved.strategy == "deepspeed") != (now.strategy == "deepspeed"):
        raise ValueError(f"checkpoint {ck} was written with trainer.strategy={saved.strategy}, "
                         f"this run uses {now.strategy}: DeepSpeed keeps its optimizer state in "
                         f"its own engine files; resume with the saved strategy{hint}")
    if now.strategy == "deepspeed" and saved.world_size != now.world_size:
        raise ValueError(f"checkpoint {ck} holds DeepSpeed ZeRO-2 optimizer partitions of world "
                         f"size {saved.world_size}, this run has world size {now.world_size}: "
                         f"resume with {saved.world_size} processes{hint}")


def load_training_state(ck: Path, head, scheduler, shape: RunShape) -> Resume:
    """Before acc.prepare, on every rank: checks, head weights, scheduler and RNG in place.
    The optimizer state is returned, to be loaded after prepare (FullState)."""
    meta = read_json(ck / "state.json")
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"checkpoint {ck} was written by an older trainer (format "
                         f"{meta.get('format', 1)}, this one reads {STATE_FORMAT}); start a new "
                         "output_dir")
    check_resume(ck, RunShape(**meta["run"]), shape)
    saved_type = read_json(ck / "head" / "config.json")["head"]["type"]
    if saved_type != head.cfg.type:
        raise ValueError(f"checkpoint {ck} holds a {saved_type!r} head, but head.type="
                         f"{head.cfg.type!r}: use another output_dir or the matching head")
    head_state = read_safetensors(ck / "head" / "model.safetensors")
    _, unexpected = head.load_state_dict(head_state, strict=False)
    lost = [k for k in head.trainable_state() if k not in head_state]
    if unexpected or lost:
        raise ValueError(f"checkpoint {ck} does not match this head: unexpected "
                         f"{unexpected[:5]}, missing {lost[:5]}")
    tensors = read_safetensors(ck / "optimizer.safetensors")
    scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(tensors.pop("rng.torch"))
    cuda_rng = tensors.pop("rng.cuda", None)
    if cuda_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda_rng)
    deepspeed = shape.strategy == "deepspeed"
    return Resume(meta["step"], meta["data_position"],
                  None if deepspeed else _unflatten_optimizer(tensors, meta["optimizer"]),
                  ck / "deepspeed" if deepspeed else None)


def _flatten_optimizer(osd: dict | None) -> tuple[dict[str, torch.Tensor], dict]:
    """Name-keyed optimizer state -> (safetensors tensors "<name>/<key>", JSON scalars)."""
    if osd is None:
        return {}, {"param_groups": [], "state": {}}
    tensors, scalars = {}, {"param_groups": [], "state": {}}
    for group in osd["param_groups"]:
        scalars["param_groups"].append(dict(group))
    for name, st in osd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0:
                tensors[f"{name}/{k}"] = v.detach().cpu().contiguous()
            else:
                scalars["state"].setdefault(name, {})[k] = float(v)
    return tensors, scalars


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], scalars: dict) -> dict:
    state: dict[str, dict] = {}
    for key, v in tensors.items():
        name, k = key.rsplit("/", 1)
        state.setdefault(name, {})[k] = v
    for name, st in scalars["state"].items():
        for k, v in st.items():
            state.setdefault(name, {})[k] = torch.tensor(v)  # AdamW's step: a float32 scalar
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v)
               for k, v in g.items()} for g in scalars["param_groups"]]
    return {"state": state, "param_groups": groups}
