"""FlashInfer attention over the paged KV cache (CUDA).

`FlashInferBackend.plan(layout)` turns the step's layout into FlashInfer metadata once; every
layer then appends its new k/v into the cache (index_copy_ on flat slots, as the torch backend
does) and runs one kernel. Which wrapper runs a step:

    layout                          wrapper                               mask
    all q_len == 1, no tree masks   BatchDecodeWithPagedKVCacheWrapper    (none needed)
    paged, anything else            BatchPrefillWithPagedKVCacheWrapper   causal or custom_mask
    cacheless (block_tables None)   BatchPrefillWithRaggedKVCacheWrapper  causal or custom_mask
    MLA (`attend_latent`), paged    BatchMLAPagedAttentionWrapper         causal (flashinfer_mla.py)

FlashInfer's causal mask is bottom-right aligned (query i of a request with kv_len K and q_len Q
sees keys j <= K - Q + i), which is the torch backend's `ctx + i` rule. Paged metadata worked
example (page_size 4, the layout.py example): request A has 6 keys in pages [7, 2, ...], B has 3
keys in page [4] ->

    qo_indptr [0, 1, 4]   paged_kv_indptr [0, 2, 3]   paged_kv_indices [7, 2, 4]
    paged_kv_last_page_len [2, 3]   (a full last page counts page_size, never 0)

FlashInfer's `plan(...)` needs head counts, head_dim and dtypes, which a BatchLayout does not
carry; the plan therefore hands them to the wrapper on its first `attend` (layer 0) and every
later layer of the step reuses that planning. Metadata and masks are built here, in `plan`.
"""
from __future__ import annotations

import functools
import importlib.util
import itertools
import math

import torch

from inference_eval.engine.attention.layout import BatchLayout

WORKSPACE_BYTES = 128 * 1024 * 1024
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# FlashInfer's "auto" picks its FA3 prefill kernels on Hopper, which failed ("operation not
# supported", H200) on SmolLM2's 9 query heads over 3 kv heads; FA2 takes every group size.
PREFILL_BACKEND = "fa2"


def available() -> bool:
    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


def paged_kv_metadata(layout: BatchLayout) -> dict[str, torch.Tensor]:
    """FlashInfer's CSR page table for a paged layout, as CPU int32 tensors.

    Returns qo_indptr [B + 1] (cumulative q_lens), paged_kv_indptr [B + 1] (cumulative page
    counts), paged_kv_indices [sum pages] (each request's first ceil(kv_len / page_size)
    page ids; unused pages at the end of a block table are dropped) and
    paged_kv_last_page_len [B] in [1, page_size].
    """
    if layout.block_tables is None:
        raise ValueError("paged_kv_metadata needs block_tables; cacheless layouts use the "
                         "ragged wrapper with qo_indptr = kv_indptr = layout.cu_q()")
    ps = layout.page_size
    kv_indptr, indices, last = [0], [], []
    for b, (table, kv) in enumerate(zip(layout.block_tables, layout.kv_lens)):
        n = -(-kv // ps)
        if len(table) < n:
            raise ValueError(f"request {b}: kv_len {kv} needs {n} pages of {ps}, block table "
                             f"has {len(table)}")
        indices.extend(table[:n])
        kv_indptr.append(kv_indptr[-1] + n)
        last.append(kv - (n - 1) * ps)
    i32 = torch.int32
    return {
        "qo_indptr": torch.tensor(layout.cu_q(), dtype=i32),
        "paged_kv_indptr": torch.tensor(kv_indptr, dtype=i32),
        "paged_kv_indices": torch.tensor(indices, dtype=i32),
        "paged_kv_last_page_len": torch.tensor(last, dtype=i32),
    }


def tree_custom_mask(layout: BatchLayout) -> torch.Tensor | None:
    """Flat bool mask [sum_b q_len_b * kv_len_b] for FlashInfer's `custom_mask`, or None.

    Request b contributes its [q_len, kv_len] mask flattened row-major (query-major), in
    request order: keys before the last m follow the causal rule (all visible), the last m
    keys follow tree_masks[b] [q_len, m] (True = may attend); causal when tree_masks[b] is None.
    """
    if layout.tree_masks is None:
        return None
    if len(layout.tree_masks) != len(layout.q_lens):
        raise ValueError(f"tree_masks has {len(layout.tree_masks)} entries for "
                         f"{len(layout.q_lens)} requests")
    parts = []
    for b, (q, kv, tm) in enumerate(zip(layout.q_lens, layout.kv_lens, layout.tree_masks)):
        ctx = kv - q
        rows = torch.arange(q).view(-1, 1)
        mask = torch.arange(kv).view(1, -1) <= ctx + rows
        if tm is not None:  # shape checked by BatchLayout: [q, m], q <= m <= kv
            mask[:, kv - tm.shape[1]:] = tm.to(device="cpu", dtype=torch.bool)
        parts.append(mask.reshape(-1))
    return torch.cat(parts)


def check_dtypes(q: torch.Tensor, k: torch.Tensor, cache_dtype: torch.dtype | None) -> None:
    """FlashInfer kernels take fp16/bf16 q and k/v of the cache's dtype; fail with a fix."""
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"FlashInfer attention supports float16/bfloat16, got {q.dtype}; set "
                         "target.dtype=bfloat16 or use attention=torch")
    if k.dtype != q.dtype or (cache_dtype is not None and cache_dtype != q.dtype):
        raise ValueError(f"q ({q.dtype}), k/v ({k.dtype}) and KV cache ({cache_dtype}) must "
                         "share one dtype")


def tensor_core_decode(heads: int, kv_heads: int) -> bool:
    """Tensor-core decode wins once a kv head serves >= 4 query heads (GQA)."""
    return heads // kv_heads >= 4


def plan_wrapper(wrapper, kind: str, meta: dict[str, torch.Tensor], heads: int, kv_heads: int,
                 d: int, page_size: int, dtype: torch.dtype,
                 custom_mask: torch.Tensor | None = None) -> None:
    """Plan a FlashInfer wrapper of `kind` (decode / paged / ragged) for a step's metadata
    (paged_kv_metadata, or qo/kv indptr of a ragged step), causal unless custom_mask."""
    common = dict(sm_scale=1.0 / math.sqrt(d), q_data_type=dtype, kv_data_type=dtype)
    m = meta
    if kind == "decode":
        wrapper.plan(m["paged_kv_indptr"], m["paged_kv_indices"], m["paged_kv_last_page_len"],
                     heads, kv_heads, d, page_size, **common)
    elif kind == "paged":
        wrapper.plan(m["qo_indptr"], m["paged_kv_indptr"], m["paged_kv_indices"],
                     m["paged_kv_last_page_len"], heads, kv_heads, d, page_size,
                     custom_mask=custom_mask, causal=True, **common)
    else:
        wrapper.plan(m["qo_indptr"], m["kv_indptr"], heads, kv_heads, d,
                     custom_mask=custom_mask, causal=True, **common)


def append_kv(cache, layer: int, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write k/v [T, kv_heads, d] to the flat cache `slots` [T] of `layer`; -> (k, v) pages."""
    kc, vc = cache.layer(layer)
    kvh, d = k.shape[1], k.shape[2]
    kc.view(-1, kvh, d).index_copy_(0, slots, k)
    vc.view(-1, kvh, d).index_copy_(0, slots, v)
    return kc, vc


class FlashInferPlan:
    """One step's FlashInfer metadata. `attend` per layer: q [T, heads, d], k/v
    [T, kv_heads, d] (fp16/bf16) -> [T, heads, d]; appends k/v to `cache` first when paged."""

    def __init__(self, backend: "FlashInferBackend", layout: BatchLayout) -> None:
        dev = backend.device
        self.backend, self.layout = backend, layout
        self.id = next(backend._plan_ids)
        self.num_tokens = layout.num_tokens
        self.positions = layout.position_tensor(dev)
        self.cached = layout.block_tables is not None
        self.kind = ("decode" if layout.is_decode else "paged") if self.cached else "ragged"
        self.graphs = backend.graphs  # model/cuda_graphs.CudaGraphs, or None
        if self.cached:
            self.meta_host = paged_kv_metadata(layout)  # what a CUDA-graph wrapper plans from
            self.slots = layout.slot_mapping(dev)
        mask = tree_custom_mask(layout)
        self.custom_mask = None if mask is None else mask.to(dev)
        self._mla = None  # flashinfer_mla.FlashInferMLA, made by the first attend_latent

    @functools.cached_property
    def meta(self) -> dict[str, torch.Tensor]:
        """The metadata on the device, for the eager wrappers; made on first use (a step that
        replays as a CUDA graph plans from meta_host). On the device because FlashInfer packs
        custom_mask with a CUDA kernel that, in some releases, wants mask_indptr (derived
        from qo_indptr) on the mask's device."""
        dev = self.backend.device
        if self.cached:
            return {k: t.to(dev) for k, t in self.meta_host.items()}
        cu = torch.tensor(self.layout.cu_q(), dtype=torch.int32, device=dev)
        return {"qo_indptr": cu, "kv_indptr": cu}

    def _ensure_planned(self, q: torch.Tensor, k: torch.Tensor):
        """Run the wrapper's plan on first use (or after another plan took the wrapper)."""
        heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
        key = (self.kind, self.kind == "decode" and tensor_core_decode(heads, kv_heads))
        wrapper = self.backend._wrapper(*key)
        sig = (self.id, heads, kv_heads, d, q.dtype)
        if self.backend._owner.get(key) == sig:
            return wrapper
        plan_wrapper(wrapper, self.kind, self.meta, heads, kv_heads, d, self.layout.page_size,
                     q.dtype, self.custom_mask)
        self.backend._owner[key] = sig
        return wrapper

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache) -> torch.Tensor:
        t, heads, d = q.shape
        if t != self.num_tokens:
            raise ValueError(f"plan is for {self.num_tokens} tokens, got q with {t}")
        if self.cached:
            check_dtypes(q, k, cache.layer(layer)[0].dtype)
            return self._ensure_planned(q, k).run(q, append_kv(cache, layer, self.slots, k, v))
        check_dtypes(q, k, None)
        # v is usually a strided slice of the fused qkv output; hand the kernel dense rows.
        return self._ensure_planned(q, k).run(q, k.contiguous(), v.contiguous())

    def attend_latent(self, layer: int, q: torch.Tensor, latent: torch.Tensor, cache,
                      v_dim: int, scale: float) -> torch.Tensor:
        """MLA (absorbed): q [T, heads, D], latent rows [T, 1, D] (fp16/bf16) -> [T, heads,
        v_dim] with FlashInfer's MLA kernel; appends the rows to `cache` first. Paged layouts
        only; tree-masked steps fall back to the torch path (flashinfer_mla.py)."""
        from inference_eval.engine.attention import flashinfer_mla

        if cache is None:
            raise NotImplementedError(flashinfer_mla.NO_CACHE_MSG)
        if q.shape[0] != self.num_tokens:
            raise ValueError(f"plan is for {self.num_tokens} tokens, got q with {q.shape[0]}")
        if self._mla is None:
            self._mla = flashinfer_mla.FlashInferMLA(self)
        return self._mla.attend(layer, q, latent, cache, v_dim, scale)


class FlashInferBackend:
    """Owns one 128 MB float workspace (shared by the wrappers; their runs are serialized on
    the stream) and one wrapper per kind, created on first use.

    Plans of different kinds can be live together (e.g. a target prefill and a draft decode).
    A wrapper holds one planning at a time: if another plan of the same kind runs in between,
    the older plan re-plans on its next `attend`, which is correct but costs a plan call.
    """

    name = "flashinfer"
    graphs = None  # model/cuda_graphs.CudaGraphs when the engine replays steps as CUDA graphs

    def __init__(self, device: torch.device | str = "cuda",
                 workspace_bytes: int = WORKSPACE_BYTES, module=None) -> None:
        """module: the flashinfer package (default); tests pass a CPU stand-in with its API."""
        if module is None:
            import flashinfer as module

            if torch.device(device).type != "cuda":
                raise ValueError(f"FlashInferBackend needs a CUDA device, got {device}")
        self._fi = module
        self.device = torch.device(device)
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._wrappers: dict[tuple[str, bool], object] = {}
        self._owner: dict[tuple[str, bool], tuple] = {}  # wrapper key -> plan signature
        self._plan_ids = itertools.count()

    def _wrapper(self, kind: str, tensor_cores: bool = False):
        key = (kind, tensor_cores)
        if key not in self._wrappers:
            fi, ws = self._fi, self.workspace
            if kind == "decode":
                w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD",
                                                          use_tensor_cores=tensor_cores)
            elif kind == "paged":
                w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=PREFILL_BACKEND)
            elif kind == "mla":
                from inference_eval.engine.attention.flashinfer_mla import new_wrapper

                w = new_wrapper(fi, ws)
            else:
                w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=PREFILL_BACKEND)
            self._wrappers[key] = w
        return self._wrappers[key]

    def graph_wrapper(self, kind: str, batch: int, max_pages: int, tensor_cores: bool = False):
        """A wrapper in FlashInfer's CUDA-graph mode for `batch` requests (decode, or paged
        without a custom mask): its page table lives in fixed device buffers that every later
        plan overwrites, so a graph captured around its `run` replays with any table of that
        batch size (max_pages: the most pages one step can list)."""
        i32 = dict(dtype=torch.int32, device=self.device)
        indptr, last = torch.zeros(batch + 1, **i32), torch.zeros(batch, **i32)
        indices = torch.zeros(max_pages, **i32)
        if kind == "decode":
            return self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last)
        if kind != "paged":
            raise ValueError(f"no CUDA-graph wrapper for {kind!r} steps")
        return self._fi.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=torch.zeros(batch + 1, **i32),
            paged_kv_indptr_buf=indptr, paged_kv_indices_buf=indices,
            paged_kv_last_page_len_buf=last, backend=PREFILL_BACKEND)

    def plan(self, layout: BatchLayout) -> FlashInferPlan:
        return FlashInferPlan(self, layout)
