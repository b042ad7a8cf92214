"""Run the engine's target over packed batches and collect what a shard stores.

Uses the engine's own model and attention backend in cacheless packed mode, with lm_head
skipped (precompute needs no logits), so the stored states are exactly what the engine
computes at serving time.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from inference_eval.engine.attention import AttentionBackend, BatchLayout
from inference_eval.engine.model.linear import openblas_threads
from inference_eval.engine.model.transformer import TransformerLM
from inference_eval.engine.threads import torch_threads
from precompute.data import TokenizedRecord
from precompute.plan import plan_batches
from precompute.shard_io import Shard, quantize_fp8

STORE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@torch.inference_mode()
def build_shard(model: TransformerLM, backend: AttentionBackend, records: Sequence[TokenizedRecord],
                *, batch_tokens: int, aux_layers: Sequence[int], hidden_dtype: str,
                on_batch: Callable[[int], None] | None = None) -> Shard:
    """Forward `records` in length-sorted packed batches; rows come back in record order.

    Batches hold at most `batch_tokens` padded tokens (B * longest); the plan depends only on
    the lengths, so a rerun repeats the same GEMM shapes and the same bytes. Returns a Shard
    with input_ids int32 [N], loss_mask uint8 [N], hidden [N, H] (last layer, pre final norm;
    `hidden_dtype`, or fp8 e4m3 with a per-token fp32 scale [N]), aux [N, A, H] if asked
    (bf16 under fp8), cu_seqlens int64 [S+1].
    """
    lengths = [len(r.input_ids) for r in records]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    total, h = offsets[-1], model.arch.hidden_size
    store = torch.float32 if hidden_dtype == "fp8" else STORE_DTYPES[hidden_dtype]
    hidden = torch.empty(total, h, dtype=store)
    aux = torch.empty(total, len(aux_layers), h, dtype=store) if aux_layers else None
    device = next(model.parameters()).device
    # Where OpenBLAS runs the products (CPU fp32), torch's OpenMP pool spins beside its threads
    # and both slow down. Measured on 2 cores, SmolLM2, first 8 ShareGPT chats: 128 tok/s with
    # torch at 1 thread vs 89 at 2 (bench_precompute.py --threads-check 8; 186 vs 112 on 16
    # chats). So torch gets one thread there, as in LLMEngine.step (linear.openblas_threads);
    # the GEMMs, most of the work, still run on every core.
    with torch_threads(openblas_threads(model.cpu_blas and device.type == "cpu")):
        for batch in plan_batches(range(len(records)), lengths, batch_tokens):
            rows = forward_batch(model, backend, [records[i] for i in batch], aux_layers, store)
            for i, (h, a) in zip(batch, rows):
                hidden[offsets[i]:offsets[i] + lengths[i]] = h
                if aux is not None:
                    aux[offsets[i]:offsets[i] + lengths[i]] = a
            if on_batch is not None:
                on_batch(sum(lengths[i] for i in batch))
    scale = None
    if hidden_dtype == "fp8":
        hidden, scale = quantize_fp8(hidden)
        if aux is not None:  # aux layers keep bf16: they are inputs, not distillation targets
            aux = aux.to(torch.bfloat16)
    return Shard(
        input_ids=torch.tensor([t for r in records for t in r.input_ids], dtype=torch.int32),
        loss_mask=torch.tensor([m for r in records for m in r.loss_mask], dtype=torch.uint8),
        hidden=hidden, cu_seqlens=torch.tensor(offsets, dtype=torch.int64), aux_hidden=aux,
        hidden_scale=scale, record_ids=[r.id for r in records])



@torch.inference_mode()
def forward_batch(model: TransformerLM, backend: AttentionBackend,
                  records: Sequence[TokenizedRecord], aux_layers: Sequence[int],
                  store: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """One packed cacheless forward of `records`; per record (hidden [T, H], aux [T, A, H] or
    None) on the CPU in `store`. The states of a record depend on the batch it runs in (the
    kernels' row blocking), so precompute and online training (train/online.py) both run the
    batches of plan_batches through this one function: the same batches give the same bits."""
    device = next(model.parameters()).device
    lengths = [len(r.input_ids) for r in records]
    ids = torch.tensor([t for r in records for t in r.input_ids], dtype=torch.long,
                       device=device)
    out = model(ids, backend.plan(BatchLayout.packed(lengths)), None, compute_logits=False,
                aux_layers=aux_layers)
    rows, start = [], 0
    for n in lengths:
        a = None if out.aux is None else out.aux[start:start + n].to("cpu", store)
        rows.append((out.hidden[start:start + n].to("cpu", store), a))
        start += n
    return rows
