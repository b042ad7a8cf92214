"""Read only this rank's slices of a Hugging Face safetensors checkpoint.

safetensors' `get_slice` reads the byte ranges of the rows or columns asked for (a sharded
row is contiguous on disk; a column range is a strided read of each row's span), so a rank
of a T-way split reads about 1/T of every split tensor and the norms whole: a 70B target
never passes through one rank's memory. The GGUF path reads its converted cache the same way
(target_hf_dir materializes it once, on the leader first).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from inference_eval.engine.model.arch import ModelArch
from inference_eval.engine.model.weights import hf_name_to_ours
from inference_eval.engine.parallel.shard import ShardSpec
from inference_eval.engine.target import safetensors_files


def _runs(pos: torch.Tensor, src: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split (local position, source index) pairs, both ascending, into contiguous runs
    (local start, source start, length)."""
    out, i, n = [], 0, pos.numel()
    p, s = pos.tolist(), src.tolist()
    while i < n:
        j = i + 1
        while j < n and p[j] == p[j - 1] + 1 and s[j] == s[j - 1] + 1:
            j += 1
        out.append((p[i], s[i], j - i))
        i = j
    return out


def load_sharded(model: nn.Module, arch: ModelArch, specs: dict[str, ShardSpec],
                 hf_dir: Path) -> None:
    """Fill a parallelized model (tp.parallelize) from hf_dir's safetensors, reading only the
    slices `specs` names; every local row must be covered (padding counts as covered)."""
    params = dict(model.named_parameters())
    cover = {n: (specs[n].index < 0 if specs[n].dim is not None
                 else torch.zeros(1, dtype=torch.bool)) for n in params}
    for path in safetensors_files(hf_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                mapped = hf_name_to_ours(name, arch)
                if mapped is None:
                    continue
                ours, rows = mapped
                if ours not in params:
                    raise ValueError(f"{hf_dir}: tensor {name!r} maps to {ours!r}, which this "
                                     f"{arch.architecture} config does not have")
                _load_one(f, name, params[ours], specs[ours], rows, cover[ours], hf_dir)
    missing = [n for n, c in cover.items() if not bool(c.all())]
    if missing:
        raise ValueError(f"{hf_dir}: checkpoint lacks tensors for {missing[:6]}"
                         f"{' ...' if len(missing) > 6 else ''}")


def _load_one(f, name: str, p: torch.Tensor, spec: ShardSpec, rows: slice | None,
              cover: torch.Tensor, source) -> None:
    sl = f.get_slice(name)
    shape = tuple(sl.get_shape())
    if spec.dim is None:
        t = f.get_tensor(name)
        dst = p.data if rows is None else p.data[rows]
        _check(name, tuple(t.shape), tuple(dst.shape), source)
        dst.copy_(t.to(dst.dtype))
        cover[...] = True
        return
    # The HF tensor covers global indices [lo, hi) of our (fused) parameter along dim 0.
    lo, hi = (0, shape[0]) if rows is None else (rows.start, rows.stop)
    if spec.dim == 0:
        _check(name, shape[1:], tuple(p.shape[1:]), source)
        sel = ((spec.index >= lo) & (spec.index < hi)).nonzero().flatten()
        for at, src, n in _runs(sel, spec.index[sel] - lo):
            p.data[at:at + n].copy_(sl[src:src + n].to(p.dtype))
        cover[sel] = True
    else:  # columns: the whole row range, only our columns
        _check(name, (shape[0],), (p.shape[0],), source)
        sel = (spec.index >= 0).nonzero().flatten()
        for at, src, n in _runs(sel, spec.index[sel]):
            p.data[:, at:at + n].copy_(sl[:, src:src + n].to(p.dtype))
        cover[sel] = True


def _check(name: str, got: tuple, want: tuple, source) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"{source}: tensor {name!r} has shape {got}, expected {want}")
