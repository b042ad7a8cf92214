"""Training checkpoints: head weights, optimizer, scheduler, RNG and data position.

Tensors go to safetensors (optimizer state flattened by parameter index), the rest to JSON,
each file written under a temp name and renamed; `latest` is updated last, so a kill leaves
either the previous or the new checkpoint, never a mix. Nothing is unpickled on load.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from heads.checkpoint import save_head


def save_training_state(root: Path, step: int, head, optimizer, scheduler, data_consumed: int,
                        metrics: dict, keep: int = 2) -> Path:
    from safetensors.torch import save_file

    ck = root / f"step_{step:08d}"
    tmp = root / f".step_{step:08d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_head(head, tmp / "head")
    tensors, scalars = {}, {"param_groups": [], "state": {}}
    for gi, group in enumerate(optimizer.param_groups):
        scalars["param_groups"].append({k: v for k, v in group.items() if k != "params"})
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pi, p in enumerate(params):
        st = optimizer.state.get(p, {})
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0:
                tensors[f"{pi}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars["state"].setdefault(str(pi), {})[k] = float(v)
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "state.json").write_text(json.dumps({
        "step": step, "data_consumed": data_consumed, "optimizer": scalars,
        "scheduler": scheduler.state_dict(), "metrics": metrics}, indent=1))
    shutil.rmtree(ck, ignore_errors=True)
    os.replace(tmp, ck)
    latest = root / "latest"
    (root / ".latest.tmp").write_text(ck.name)
    os.replace(root / ".latest.tmp", latest)
    for old in sorted(root.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return ck


def latest_checkpoint(root: Path) -> Path | None:
    p = root / "latest"
    if not p.is_file():
        return None
    ck = root / p.read_text().strip()
    return ck if (ck / "state.json").is_file() else None


def load_training_state(ck: Path, head, optimizer, scheduler) -> tuple[int, int]:
    """Restore everything in place; returns (step, micro-batches consumed)."""
    from safetensors.torch import load_file

    saved_type = json.loads((ck / "head" / "config.json").read_text())["head"]["type"]
    if saved_type != head.cfg.type:
        raise ValueError(f"checkpoint {ck} holds a {saved_type!r} head, but head.type="
                         f"{head.cfg.type!r}: use another output_dir or the matching head")
    head_state = load_file(str(ck / "head" / "model.safetensors"))
    missing, unexpected = head.load_state_dict(head_state, strict=False)
    lost = [k for k in head.trainable_state() if k not in head_state]
    if unexpected or lost:
        raise ValueError(f"checkpoint {ck} does not match this head: unexpected "
                         f"{unexpected[:5]}, missing {lost[:5]}")
    meta = json.loads((ck / "state.json").read_text())
    tensors = load_file(str(ck / "optimizer.safetensors"))
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pi, p in enumerate(params):
        st = {k.split(".", 1)[1]: v.to(p.device) for k, v in tensors.items() if k.split(".", 1)[0] == str(pi)}
        for k, v in meta["optimizer"]["state"].get(str(pi), {}).items():
            st[k] = torch.tensor(v)
        if st:
            optimizer.state[p] = st
    for group, saved in zip(optimizer.param_groups, meta["optimizer"]["param_groups"]):
        group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items()})
    scheduler.load_state_dict(meta["scheduler"])
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    return meta["step"], meta["data_consumed"]
