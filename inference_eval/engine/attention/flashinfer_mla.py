"""FlashInfer's MLA kernel over the latent KV cache (CUDA; DeepSeek targets).

A FlashInferPlan answers `attend_latent` (see mla_torch.py for the absorbed form) with
`flashinfer.mla.BatchMLAPagedAttentionWrapper`: planned once per step (on the first layer's
call, when heads and dtypes are known; later layers reuse it), run once per layer. The append
of the step's latent rows into the cache happens first, as in the other backends.

Layout mapping, no copies (D = r + p, r = kv_lora_rank = v_dim, p = qk_rope_head_dim):

    ours                                         FlashInfer run(...)
    q [T, heads, D] = [q_nope W_uk ; q_pe]       q_nope = q[..., :r]   [T, heads, r]
                                                 q_pe   = q[..., r:]   [T, heads, p]
    cache.k[layer] [pages, page_size, 1, D]      ckv_cache = rows[..., :r]  [pages, page_size, r]
      rows = view [pages, page_size, D]          kpe_cache = rows[..., r:]  [pages, page_size, p]
    output [T, heads, v_dim]                     out [T, heads, r] (values = c_kv)

All four inputs are strided views: FlashInfer's launcher (csrc/batch_mla_run.cu, also
batch_mla_sm90_run.cu) reads the token and head strides of q_nope/q_pe/out and the page and
token strides of ckv/kpe, and needs only a unit last-dim stride, which slices keep. So the
cache layout the torch path uses serves the kernel unchanged.

Plan metadata (`mla_paged_metadata`), the layout.py example at page_size 4 (A: 6 keys in
pages [7, 2], 1 new token; B: 3 new keys in page [4]):

    qo_indptr [0, 1, 4]   kv_indptr [0, 2, 3]   kv_indices [7, 2, 4]   kv_len_arr [6, 3]

kv_indptr counts pages, kv_len_arr tokens (so no last-page length). causal=True: FlashInfer's
causal mask is bottom-right aligned (query i of a request with kv_len K and q_len Q sees keys
j <= K - Q + i), the torch backend's rule; a decode query sees all its keys. The kernel's
sm_scale is MLA's own softmax scale (model/mla.py: 1/sqrt(n + p), times YaRN's mscale^2),
passed as is; the torch path instead pre-scales q against SDPA's 1/sqrt(D).

Supported: paged layouts (decode, prefill, chunked prefill mixed with decode), fp16/bf16,
kv_lora_rank a multiple of 128 up to 512 and qk_rope_head_dim 64 (the kernel's 128-byte
swizzled rows and its two warpgroups each holding half of the output; DeepSeek-V2/V3's
512 + 64 is the shape FlashInfer's own tests cover).

Tree masks: the MLA kernel knows causal and non-causal only (plan takes no custom_mask; the
kernel returns cudaErrorNotSupported for MaskMode::kCustom, include/flashinfer/attention/
mla.cuh). A layout with a tree mask (tree verification, draft-tree construction) therefore
FALLS BACK explicitly, for that step, to the torch latent path (TorchAttentionPlan over the
same cache: SDPA on gathered rows), with a UserWarning. Results are the torch backend's;
the cost is the torch path's. A native route would run the kernel non-causally over the
prefix keys and merge (by LSE) a small masked part over the last m keys.

Refused with an error naming the fix:
  fp32 q or cache                  ValueError (check_dtypes: target.dtype=bfloat16 or torch)
  other kv_lora_rank / rope dims   ValueError (engine.attention=torch)
  cacheless (packed) layouts       NotImplementedError (engine.attention=torch): there is no
      paged cache to read; FlashInfer's kernel for whole-sequence MLA passes is the ragged
      prefill in the non-absorbed form (head_dim_qk n + p, head_dim_vo v), which needs
      mla.py's expanded keys, not implemented here.
  flashinfer without flashinfer.mla (before 0.2.1)   ValueError
FP8 latent caches and CUDA graphs are not used here.
"""
from __future__ import annotations

import warnings

import torch

from inference_eval.engine.attention.flashinfer_backend import check_dtypes, paged_kv_metadata
from inference_eval.engine.attention.layout import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionPlan

MLA_KEY = ("mla", False)  # the backend's wrapper slot for the MLA kernel
KPE_DIM = 64
CKV_STEP, CKV_MAX = 128, 512
NO_CACHE_MSG = (
    "FlashInfer MLA runs on a paged latent KV cache; this layout is cacheless (a packed "
    "whole-sequence pass, e.g. precompute or validation) and the non-absorbed FlashInfer "
    "prefill it would need is not implemented: set engine.attention=torch")


def mla_paged_metadata(layout: BatchLayout) -> dict[str, torch.Tensor]:
    """The arrays BatchMLAPagedAttentionWrapper.plan takes, as CPU int32 tensors:
    qo_indptr [B + 1] (cumulative q_lens), kv_indptr [B + 1] (cumulative page counts),
    kv_indices [sum pages] (each request's first ceil(kv_len / page_size) page ids) and
    kv_len_arr [B] (keys per request, this step's included)."""
    meta = paged_kv_metadata(layout)  # raises for cacheless layouts and short block tables
    return {"qo_indptr": meta["qo_indptr"], "kv_indptr": meta["paged_kv_indptr"],
            "kv_indices": meta["paged_kv_indices"],
            "kv_len_arr": torch.tensor(layout.kv_lens, dtype=torch.int32)}


def has_tree_mask(layout: BatchLayout) -> bool:
    return layout.tree_masks is not None and any(m is not None for m in layout.tree_masks)


def check_mla_dims(ckv: int, kpe: int) -> None:
    """kv_lora_rank (ckv) and qk_rope_head_dim (kpe) the MLA kernel is built for."""
    if ckv % CKV_STEP or not 0 < ckv <= CKV_MAX or kpe != KPE_DIM:
        raise ValueError(
            f"FlashInfer MLA needs kv_lora_rank a multiple of {CKV_STEP} up to {CKV_MAX} and "
            f"qk_rope_head_dim {KPE_DIM} (DeepSeek-V2/V3: 512 and 64), got {ckv} and {kpe}; "
            "set engine.attention=torch")


def new_wrapper(fi, workspace: torch.Tensor):
    """A BatchMLAPagedAttentionWrapper on the backend's float workspace (its default kernel
    backend: fa3 on Hopper, else fa2)."""
    cls = getattr(getattr(fi, "mla", None), "BatchMLAPagedAttentionWrapper", None)
    if cls is None:
        raise ValueError(f"flashinfer {getattr(fi, '__version__', '?')} has no "
                         "flashinfer.mla.BatchMLAPagedAttentionWrapper; DeepSeek (MLA) targets "
                         "need flashinfer-python >= 0.2.1, or set engine.attention=torch")
    return cls(workspace)


class FlashInferMLA:
    """The MLA side of one FlashInferPlan, made on its first `attend_latent`: the kernel's
    metadata, or the torch fallback plan when the layout has tree masks."""

    def __init__(self, plan) -> None:
        self.plan = plan
        self.fallback = None
        self.meta = None
        if has_tree_mask(plan.layout):
            warnings.warn("FlashInfer MLA has no custom (tree) masks: this step's latent "
                          "attention falls back to the torch path (SDPA over the same cache)",
                          UserWarning, stacklevel=2)
            self.fallback = TorchAttentionPlan(plan.layout, plan.backend.device)
        else:
            self.meta = mla_paged_metadata(plan.layout)

    def attend(self, layer: int, q: torch.Tensor, latent: torch.Tensor, cache, v_dim: int,
               scale: float) -> torch.Tensor:
        """q [T, heads, D], latent [T, 1, D] (fp16/bf16) -> [T, heads, v_dim]; appends the
        latent rows to `cache` (layer `layer`) first."""
        t, heads, d = q.shape
        kc, vc = cache.layer(layer)
        check_dtypes(q, latent, kc.dtype)
        if self.fallback is not None:
            return self.fallback.attend_latent(layer, q, latent, cache, v_dim, scale)
        if kc.shape[2] != 1 or kc.shape[3] != d or latent.shape[1:] != (1, d):
            raise ValueError(f"FlashInfer MLA needs latent rows [T, 1, {d}] and a cache of "
                             f"one {d}-wide row per token, got latent {tuple(latent.shape)} "
                             f"and cache rows {tuple(kc.shape[2:])}")
        # Planned (and its dims checked) before the append, so a refusal leaves the cache as is.
        wrapper = self._ensure_planned(heads, v_dim, d - v_dim, scale, q.dtype, kc.dtype)
        rows = latent.reshape(t, d)
        kc.view(-1, d).index_copy_(0, self.plan.slots, rows)
        if vc is not kc:  # a K/V cache given MLA rows: keep it as the torch path leaves it
            vc.view(-1, d).index_copy_(0, self.plan.slots, rows)
        paged = kc.view(kc.shape[0], kc.shape[1], d)
        return wrapper.run(q[..., :v_dim], q[..., v_dim:], paged[..., :v_dim], paged[..., v_dim:])

    def _ensure_planned(self, heads: int, ckv: int, kpe: int, scale: float, q_dtype, kv_dtype):
        """Plan the backend's MLA wrapper for this step unless it already holds this plan's
        planning (another plan in between, e.g. a draft's, makes it plan again)."""
        backend = self.plan.backend
        wrapper = backend._wrapper(*MLA_KEY)
        sig = (self.plan.id, heads, ckv, kpe, scale, q_dtype, kv_dtype)
        if backend._owner.get(MLA_KEY) == sig:
            return wrapper
        check_mla_dims(ckv, kpe)
        m = self.meta
        wrapper.plan(m["qo_indptr"], m["kv_indptr"], m["kv_indices"], m["kv_len_arr"], heads,
                     ckv, kpe, self.plan.layout.page_size, True, scale, q_dtype, kv_dtype)
        backend._owner[MLA_KEY] = sig
        return wrapper
