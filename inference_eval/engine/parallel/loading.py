"""Read only this rank's slices of a Hugging Face safetensors checkpoint.

safetensors' `get_slice` reads the byte ranges of the rows or columns asked for (a sharded
row is contiguous on disk; a column range is a strided read of each row's span), so a rank
of a T-way split reads about 1/T of every split tensor and the norms whole: a 70B target
never passes through one rank's memory. The GGUF path reads its converted cache the same way
(target_hf_dir materializes it once, on the leader first).

Each checkpoint tensor is a block of one of our parameters, named by the weight-name
adapters (model/weights.py, model/deepseek_weights.py) as an index prefix: rows of a fused
projection (`slice`), one routed expert (`(e,)`), or its gate or up rows (`(e, slice)`).
Against the parameter's split dimension d (shard.py) that gives three cases:

| the block along d | what the rank reads |
|---|---|
| replicated parameter (no d) | the tensor whole (get_tensor) |
| one index of d (a whole expert under expert parallelism) | the tensor whole if the rank holds that expert, else nothing |
| a range of d (rows, columns, an expert's intermediate columns) | only the rank's indices in that range, as contiguous runs |

DeepSeek's rotary row permutation (interleaved checkpoints) is a reordering of rows within
each head, so a rank reads its heads' rows and reorders them in memory.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from inference_eval.engine.model.arch import DEEPSEEK_ARCHITECTURES, ModelArch
from inference_eval.engine.model.weights import hf_name_to_ours
from inference_eval.engine.parallel.shard import ShardSpec
from inference_eval.engine.target import safetensors_files


def _runs(pos: torch.Tensor, src: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split (local position, source index) pairs into contiguous runs (local start, source
    start, length): both advance by one inside a run."""
    out, i, n = [], 0, pos.numel()
    p, s = pos.tolist(), src.tolist()
    while i < n:
        j = i + 1
        while j < n and p[j] == p[j - 1] + 1 and s[j] == s[j - 1] + 1:
            j += 1
        out.append((p[i], s[i], j - i))
        i = j
    return out


def _mapper(arch: ModelArch):
    """name -> (our parameter, index prefix, transform of the HF tensor) or None."""
    if arch.architecture in DEEPSEEK_ARCHITECTURES:
        from inference_eval.engine.model.deepseek_weights import deepseek_name_to_ours

        return deepseek_name_to_ours

    def llama(name: str, arch: ModelArch):
        mapped = hf_name_to_ours(name, arch)
        return None if mapped is None else (*mapped, None)

    return llama


def _cover_dims(p: torch.Tensor) -> int:
    """Coverage is tracked over a parameter's leading dims: rows, or (expert, row)."""
    return max(1, p.dim() - 1)


def load_sharded(model: nn.Module, arch: ModelArch, specs: dict[str, ShardSpec],
                 hf_dir: Path) -> None:
    """Fill a parallelized model (tp.parallelize) from hf_dir's safetensors, reading only the
    slices `specs` names; every local row must be covered (padding counts as covered)."""
    params = dict(model.named_parameters())
    cover = {}
    for n, p in params.items():
        k, spec = _cover_dims(p), specs[n]
        cover[n] = torch.zeros(p.shape[:k], dtype=torch.bool)
        if spec.dim is not None and spec.dim < k:
            shape = [1] * k
            shape[spec.dim] = -1
            cover[n] |= (spec.index < 0).view(shape)
    mapper = _mapper(arch)
    for path in safetensors_files(hf_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                try:
                    mapped = mapper(name, arch)
                except ValueError as exc:
                    raise ValueError(f"{hf_dir}: {exc}") from None
                if mapped is None:
                    continue
                ours, index, transform = mapped
                if ours not in params:
                    raise ValueError(f"{hf_dir}: tensor {name!r} maps to {ours!r}, which this "
                                     f"{arch.architecture} config does not have")
                prefix = () if index is None else (index if isinstance(index, tuple) else (index,))
                _load_one(f, name, params[ours], specs[ours], prefix, transform, cover[ours],
                          hf_dir)
    missing = [n for n, c in cover.items() if not bool(c.all())]
    if missing:
        raise ValueError(f"{hf_dir}: checkpoint lacks tensors for {missing[:6]}"
                         f"{' ...' if len(missing) > 6 else ''}")


def _load_one(f, name: str, p: torch.Tensor, spec: ShardSpec, prefix: tuple, transform,
              cover: torch.Tensor, source) -> None:
    """Copy this rank's part of checkpoint tensor `name` (= full[prefix] of our parameter p's
    full form) into p, and mark it in `cover`."""
    k, d = cover.dim(), spec.dim
    base = list(prefix) + [slice(None)] * (p.dim() - len(prefix))
    if d is None:
        t = f.get_tensor(name)
        t = t if transform is None else transform(t)
        dst = p.data[tuple(base)]
        _check(name, tuple(t.shape), tuple(dst.shape), source)
        dst.copy_(t.to(dst.dtype))
        cover[tuple(base[:k])] = True
        return
    sl = f.get_slice(name)
    shape = tuple(sl.get_shape())
    if d < len(prefix) and isinstance(prefix[d], int):  # one routed expert: ours, or not read
        held = (spec.index == prefix[d]).nonzero().flatten()
        if held.numel() == 0:
            return
        base[d] = int(held[0])
        dst = p.data[tuple(base)]
        _check(name, shape, tuple(dst.shape), source)
        t = sl[tuple(slice(None) for _ in shape)]
        dst.copy_((t if transform is None else transform(t)).to(dst.dtype))
        cover[tuple(base[:k])] = True
        return
    # The tensor spans global indices [lo, hi) of our dim d, which is its own dim td.
    td = d - sum(isinstance(i, int) for i in prefix[:d])
    lo, hi = (prefix[d].start, prefix[d].stop) if d < len(prefix) else (0, shape[td])
    base[d] = slice(None)
    region = p.data[tuple(base)]
    _check(name, _drop(shape, td), _drop(tuple(region.shape), td), source)
    sel = ((spec.index >= lo) & (spec.index < hi)).nonzero().flatten()
    if sel.numel() == 0:
        return
    src = spec.index[sel] - lo
    if transform is not None and td == 0:  # a row permutation: read the rows, reorder them
        src = transform(torch.arange(shape[0]).unsqueeze(1)).squeeze(1)[src]
        rows, order = torch.unique(src, return_inverse=True)
        got = torch.cat([sl[_key(len(shape), td, s, n)]
                         for _, s, n in _runs(torch.arange(rows.numel()), rows)], dim=td)
        region.index_copy_(td, sel,
                           got.index_select(td, order).to(p.dtype))
    else:
        for at, s, n in _runs(sel, src):
            chunk = sl[_key(len(shape), td, s, n)]
            chunk = chunk if transform is None else transform(chunk)
            idx = list(base)
            idx[d] = slice(at, at + n)
            p.data[tuple(idx)].copy_(chunk.to(p.dtype))
    cidx = base[:k]
    if d < k:
        cidx[d] = sel
    cover[tuple(cidx)] = True


def _key(ndim: int, dim: int, start: int, n: int) -> tuple:
    key = [slice(None)] * ndim
    key[dim] = slice(start, start + n)
    return tuple(key)


def _drop(shape: tuple, dim: int) -> tuple:
    return shape[:dim] + shape[dim + 1:]


def _check(name: str, got: tuple, want: tuple, source) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"{source}: tensor {name!r} has shape {got}, expected {want}")
