"""Shard files: one safetensors file per shard, written atomically, verified on load.

Tensors (docs/data.md): input_ids int32 [N], loss_mask uint8 [N], hidden [N, H]
(bf16 by default; fp8 e4m3 with hidden_scale fp32 [N] as an option), optional aux_hidden
[N, A, H], cu_seqlens int64 [S+1]. N tokens of S packed sequences.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn value


class ShardIntegrityError(ValueError):
    pass


@dataclass
class Shard:
    input_ids: torch.Tensor  # [N] int32
    loss_mask: torch.Tensor  # [N] uint8
    hidden: torch.Tensor  # [N, H] in the stored dtype
    cu_seqlens: torch.Tensor  # [S+1] int64
    aux_hidden: torch.Tensor | None = None  # [N, A, H]
    hidden_scale: torch.Tensor | None = None  # [N] fp32, fp8 only
    record_ids: list[str] | None = None

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    def hidden_float(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Hidden states [N, H] dequantized to `dtype`."""
        h = self.hidden.to(dtype)
        return h if self.hidden_scale is None else h * self.hidden_scale.to(dtype).unsqueeze(-1)


def bytes_per_token(hidden_size: int, num_aux: int, hidden_dtype: str) -> int:
    """Stored bytes per token: input_ids 4 + loss_mask 1 + hidden (+ fp8 scale 4) + aux.

    Excludes cu_seqlens (8 per sequence) and the safetensors header (a few hundred bytes)."""
    if hidden_dtype == "fp8":  # fp8 e4m3 + an fp32 scale per token; aux stays bf16 (dump.py)
        hidden, aux = hidden_size * 1 + 4, num_aux * hidden_size * 2
    else:
        elt = torch.empty((), dtype=getattr(torch, hidden_dtype)).element_size()
        hidden, aux = hidden_size * elt, num_aux * hidden_size * elt
    return 4 + 1 + hidden + aux


def quantize_fp8(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token scaled fp8: h [N, H] -> (fp8 [N, H], scale fp32 [N])."""
    scale = (h.float().abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    return (h.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def write_shard(path: Path, shard: Shard) -> str:
    """Write to a temp name, fsync, rename; returns the file's sha256."""
    from safetensors.torch import save_file

    tensors = {"input_ids": shard.input_ids.to(torch.int32).contiguous(),
               "loss_mask": shard.loss_mask.to(torch.uint8).contiguous(),
               "hidden": shard.hidden.contiguous(),
               "cu_seqlens": shard.cu_seqlens.to(torch.int64).contiguous()}
    if shard.aux_hidden is not None:
        tensors["aux_hidden"] = shard.aux_hidden.contiguous()
    if shard.hidden_scale is not None:
        tensors["hidden_scale"] = shard.hidden_scale.float().contiguous()
    meta = {"record_ids": json.dumps(shard.record_ids or [])}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    # safetensors creates files 0600; shards are usually read by other users and containers
    # (training jobs), so give them the permissions the umask allows, like any other file.
    os.chmod(tmp, 0o666 & ~_umask())
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    digest = file_sha256(tmp)
    os.replace(tmp, path)
    return digest


def read_shard(path: Path, sha256: str | None = None) -> Shard:
    """Load a shard (memory-mapped by safetensors); with `sha256`, verify it first and raise
    ShardIntegrityError naming the file on mismatch."""
    from safetensors import safe_open

    if not path.is_file():
        raise FileNotFoundError(f"shard {path} is missing; rerun precompute to resume it")
    if sha256 is not None:
        got = file_sha256(path)
        if got != sha256:
            raise ShardIntegrityError(
                f"shard {path} is corrupt: sha256 {got[:16]}... does not match the manifest's "
                f"{sha256[:16]}...; delete it and rerun precompute to rewrite it")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            meta = f.metadata() or {}
            get = f.get_tensor
            shard = Shard(input_ids=get("input_ids"), loss_mask=get("loss_mask"),
                          hidden=get("hidden"), cu_seqlens=get("cu_seqlens"),
                          aux_hidden=get("aux_hidden") if "aux_hidden" in keys else None,
                          hidden_scale=get("hidden_scale") if "hidden_scale" in keys else None,
                          record_ids=json.loads(meta.get("record_ids", "[]")))
    except Exception as exc:  # safetensors' own errors do not say which file
        raise ShardIntegrityError(f"shard {path} cannot be read ({exc}); delete it and rerun "
                                  "precompute to rewrite it") from exc
    problem = _check_shapes(shard)
    if problem:
        raise ShardIntegrityError(f"shard {path} is inconsistent: {problem}")
    return shard


def _check_shapes(s: Shard) -> str | None:
    n = s.input_ids.shape[0]
    if s.loss_mask.shape != (n,) or s.hidden.dim() != 2 or s.hidden.shape[0] != n:
        return (f"input_ids {tuple(s.input_ids.shape)}, loss_mask {tuple(s.loss_mask.shape)} "
                f"and hidden {tuple(s.hidden.shape)} disagree on N")
    cu = s.cu_seqlens
    if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu[1:] <= cu[:-1]).any()):
        return f"cu_seqlens must rise strictly from 0 to N={n}"
    if s.aux_hidden is not None and (s.aux_hidden.shape[0] != n or s.aux_hidden.dim() != 3):
        return f"aux_hidden {tuple(s.aux_hidden.shape)} is not [N={n}, A, H]"
    if s.hidden_scale is not None and s.hidden_scale.shape != (n,):
        return f"hidden_scale {tuple(s.hidden_scale.shape)} is not [N={n}]"
    return None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
