"""A CPU stand-in for the two paged FlashInfer wrappers the engine uses, eager and CUDA-graph
mode, plus a stand-in for a CUDA graph: what tests use to run the CUDA-graph code path
(model/cuda_graphs.py) on a machine without a GPU.

The wrappers keep FlashInfer's contract as the engine relies on it: `plan` takes the CSR page
table (flashinfer_backend.paged_kv_metadata), in CUDA-graph mode copies it into the fixed
buffers given at construction (batch size fixed, no more rows than the first plan had), and
`run(q, (k_pages, v_pages))` reads the table from those buffers when it runs, so a replay
sees whatever the latest plan wrote. Attention is a per-request loop in float32, causal
aligned bottom-right (query i of a request with q_len Q and kv_len K sees keys j <= K - Q + i).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import torch


class _PagedWrapper:
    def __init__(self, workspace, layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, qo_indptr_buf=None,
                 paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None, backend="auto"):
        self.graph = use_cuda_graph
        self.indptr = paged_kv_indptr_buffer if paged_kv_indptr_buffer is not None else paged_kv_indptr_buf
        self.indices = (paged_kv_indices_buffer if paged_kv_indices_buffer is not None
                        else paged_kv_indices_buf)
        self.last = (paged_kv_last_page_len_buffer if paged_kv_last_page_len_buffer is not None
                     else paged_kv_last_page_len_buf)
        self.qo = qo_indptr_buf
        if self.graph and any(t is None for t in (self.indptr, self.indices, self.last)):
            raise ValueError("CUDA-graph mode needs its buffers")
        self.max_rows = None
        self.plans = 0

    def _set(self, name, value):
        value = value.to(torch.int32)
        if not self.graph:
            setattr(self, name, value.clone())
            return
        buf = getattr(self, name)
        if name == "indices":
            if len(value) > len(buf):
                raise ValueError("more page indices than the buffer holds")
            buf[:len(value)].copy_(value)
        else:
            if buf.shape != value.shape:
                raise ValueError(f"the batch size is fixed in CUDA-graph mode ({name}: "
                                 f"{tuple(buf.shape)} vs {tuple(value.shape)})")
            buf.copy_(value)

    def _plan(self, qo, indptr, indices, last, heads, kv_heads, d, page_size, sm_scale, mask):
        if mask is not None:
            raise NotImplementedError("the stand-in has no custom masks")
        rows = int(qo[-1])
        if self.graph:
            if self.max_rows is None:
                self.max_rows = rows
            elif rows > self.max_rows:
                raise ValueError("more rows than the first plan in CUDA-graph mode")
        self._set("qo", qo)
        self._set("indptr", indptr)
        self._set("indices", indices)
        self._set("last", last)
        self.page_size, self.scale = page_size, sm_scale
        self.plans += 1

    def run(self, q, kv):
        kc, vc = kv
        ps, out = self.page_size, torch.empty_like(q)
        qo, indptr = self.qo.tolist(), self.indptr.tolist()
        group = q.shape[1] // kc.shape[2]
        for b in range(len(qo) - 1):
            pages = self.indices[indptr[b]:indptr[b + 1]].long()
            n = (len(pages) - 1) * ps + int(self.last[b])
            keys = kc[pages].reshape(-1, *kc.shape[2:])[:n].float().repeat_interleave(group, 1)
            vals = vc[pages].reshape(-1, *vc.shape[2:])[:n].float().repeat_interleave(group, 1)
            qb = q[qo[b]:qo[b + 1]].float()
            s = torch.einsum("qhd,khd->hqk", qb, keys) * self.scale
            ql = qb.shape[0]
            seen = torch.arange(n).view(1, -1) <= (n - ql + torch.arange(ql)).view(-1, 1)
            s = s.masked_fill(~seen, float("-inf"))
            out[qo[b]:qo[b + 1]] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vals).to(q.dtype)
        return out


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    def plan(self, indptr, indices, last, heads, kv_heads, d, page_size, sm_scale=None,
             q_data_type=None, kv_data_type=None):
        qo = torch.arange(len(last) + 1, dtype=torch.int32)
        if self.graph and self.qo is None:
            self.qo = torch.zeros(len(last) + 1, dtype=torch.int32)
        self._plan(qo, indptr, indices, last, heads, kv_heads, d, page_size,
                   sm_scale or 1 / math.sqrt(d), None)


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    def plan(self, qo_indptr, indptr, indices, last, heads, kv_heads, d, page_size,
             custom_mask=None, causal=True, sm_scale=None, q_data_type=None, kv_data_type=None):
        self._plan(qo_indptr, indptr, indices, last, heads, kv_heads, d, page_size,
                   sm_scale or 1 / math.sqrt(d), custom_mask)


MODULE = SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper,
                         BatchPrefillWithPagedKVCacheWrapper=BatchPrefillWithPagedKVCacheWrapper)


class FakeGraph:
    """Capture runs the step once and keeps its outputs as the graph's static outputs;
    replay runs the same closure again (it reads only the graph's own buffers, as the
    recorded kernels would) and writes the results into those outputs."""

    def capture(self, fn):
        self.fn = fn
        self.outputs = fn()
        return self.outputs

    def replay(self):
        for dst, src in zip(self.outputs, self.fn()):
            if dst is not None:
                dst.copy_(src)
