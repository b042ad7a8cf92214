"""SDPA over the paged KV cache (CPU and GPU), and cacheless packed causal attention.

Planning turns the layout into gather indices and one boolean mask per step; every layer
then does index_copy (append), one gather of its pages into [B, kv_heads, max_kv, d], and
one SDPA call. Decode-only steps skip the query padding entirely (T == B). A single request
whose pages are consecutive (the allocator hands them out in order, so batch-1 decoding and
verification nearly always are) reads its keys and values as one slice of the cache: no
gather copies the history in any layer.

Requests with very different cache lengths, padded to one [B, max_kv] batch, make every row
pay for the longest: decode steps of a batch-32 self-distillation run with a few long prompts
among short ones spent 78% of their time in SDPA over padding (py-spy, SmolLM2 on 2 cores).
So a cached step splits its requests into groups of similar kv length (`kv_groups`: sorted,
cut where it saves more padded keys than a group's fixed cost) and runs one gather + SDPA per
group; a step whose requests fit one group runs exactly as before.

A step of whole fresh sequences (precompute's packed batches, prompt prefills: every request
has q_len == kv_len, no tree mask) needs no cache read and no mask: each sequence attends
over its own packed rows with SDPA's causal mode, which skips the blocks above the diagonal.
With a [B, max_q, max_kv] boolean mask instead, SDPA computed every block and attention was
83% of precompute's torch time (torch profiler, 24 ShareGPT chats up to 2048 tokens, 1
thread): the masked form of 4 x 1000 tokens 213 ms per layer vs 142 causal, 69 on 2 threads.
These long calls run on the backend's thread count (torch's setting when it was built):
the engine and precompute keep torch at 1 thread inside CPU-BLAS steps, but one long SDPA
call per layer does not contend with OpenBLAS the way many small ops do. In fp32 on CPU,
cpu_causal's kernel replaces that loop with one call for every sequence of the step
(cpu_causal.py has the measurements); SDPA serves other dtypes and head sizes.

Decode-like fp32 steps on CPU (every request with at most cpu_paged.SMALL_Q new rows, or
cpu_paged.TREE_Q under a tree mask: EAGLE-2 verification and draft-tree levels) skip all of
the above: cpu_paged's kernel reads each request's keys and values
once from its pages, with no gather, padding or mask (cpu_paged.py has the measurements).
That includes one request verifying a chain, which used to keep SDPA over its contiguous
span: since the kernel takes its own thread count, it is faster there too (bench_spec at
batch 1 with 256 cached tokens: 1-2 ms of a ~30 ms verification step). Other dtypes fall back
to the general path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from inference_eval.engine.attention import cpu_causal, cpu_paged
from inference_eval.engine.attention.layout import BatchLayout, page_slots
from inference_eval.engine.attention.mla_torch import torch_attend_latent
from inference_eval.engine.threads import torch_threads


# The fixed cost of one more SDPA group, in padded key rows (one key row of one request): a
# group costs ~100 µs of calls and index ops on CPU, about what 200-300 key rows cost to attend.
GROUP_COST = 256
# Query rows from which a fresh causal sequence's SDPA runs on the backend's threads.
LONG_ROWS = 64


def kv_groups(kv_lens: list[int], group_cost: int = GROUP_COST) -> list[list[int]]:
    """Partition request indices into groups (each in ascending index order) minimising
    Σ_groups (size x max kv_len + group_cost) over contiguous runs of the length-sorted order;
    an exact O(B^2) dynamic program."""
    order = sorted(range(len(kv_lens)), key=lambda i: -kv_lens[i])
    n = len(order)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # group = order[i:j], its longest is order[i]
            c = best[i] + (j - i) * kv_lens[order[i]] + group_cost
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j > 0:
        groups.append(sorted(order[cut[j]:j]))
        j = cut[j]
    return groups[::-1]


class TorchAttentionPlan:
    def __init__(self, layout: BatchLayout, device: torch.device, grouped: bool = True,
                 threads: int | None = None, paged_kernel: bool = False,
                 group_of_step: bool = False, causal_kernel: bool = False) -> None:
        # paged_kernel: cpu_paged's kernel is built and the device is the CPU (the backend
        # decides once; see TorchAttentionBackend). group_of_step: this plan serves one kv
        # group of a larger step (below), whose keys the step has already appended, so it is
        # not split again and always takes the gathered path, even when all of its requests are fresh
        # prompts (a mixed self-distillation step: new prompts admitted beside decodes).
        self.layout, self.threads = layout, threads
        self.grouped = grouped and not group_of_step
        self.device = torch.device(device)
        self.num_tokens = layout.num_tokens
        self.positions = layout.position_tensor(device)
        b, q_lens, kv_lens = len(layout.q_lens), layout.q_lens, layout.kv_lens
        self.batch, self.max_q, self.max_kv = b, max(q_lens), max(kv_lens)
        self.cached = layout.block_tables is not None
        cu = layout.cu_q()
        self.groups = None
        self.kv_span = None  # (first slot, kv_len) when the keys are one contiguous run
        self.paged = None  # (block tables, cu_q, kv_lens) tensors for cpu_paged's kernel
        self.paged_masks = None  # its tree masks (cpu_paged.tree_mask_tensors), if any
        self.gathered = False  # the gather / mask / group fields below are planned
        # Packed row spans of fresh whole sequences (module docstring), else None.
        fresh = (not group_of_step and layout.tree_masks is None
                 and all(q == kv for q, kv in zip(q_lens, kv_lens)))
        self.causal_spans = list(zip(cu[:-1], cu[1:])) if fresh else None
        # causal_kernel: cpu_causal's kernel is built and the device is the CPU.
        self.cu_seqlens = torch.tensor(cu, dtype=torch.long) if fresh and causal_kernel else None
        self.slots = layout.slot_mapping(device) if self.cached else None
        self.mask = None
        self.split = None  # [(packed rows, sub-plan)] of a mixed step (below)
        if fresh:
            return
        tree = layout.tree_masks is not None
        if paged_kernel and self.cached and not tree and not group_of_step:
            self.split = _split_mixed(layout, device, threads, causal_kernel)
            if self.split is not None:
                return
        if paged_kernel and self.cached and self.max_q <= (cpu_paged.TREE_Q if tree else cpu_paged.SMALL_Q):
            self.paged = _paged_tables(layout, device)
            self.paged_masks = cpu_paged.tree_mask_tensors(layout.tree_masks) if tree else None
            return
        self._plan_gathered()

    def _plan_gathered(self) -> None:
        """The general path's plan: padded query rows, kv gathers (or a contiguous span, or
        groups of similar length) and the mask."""
        layout, device = self.layout, self.device
        b, q_lens, kv_lens, cu = self.batch, layout.q_lens, layout.kv_lens, layout.cu_q()
        self.gathered = True
        # Query rows: packed token t sits at padded row q_rows[t] of a [B * max_q] buffer.
        self.dense_q = self.max_q == 1 or b == 1
        rows = [bi * self.max_q + i for bi, q in enumerate(q_lens) for i in range(q)]
        self.q_rows = torch.tensor(rows, dtype=torch.long, device=device)
        if self.cached:
            groups = kv_groups(kv_lens) if self.grouped and b > 1 else [list(range(b))]
            if len(groups) > 1:  # each group plans its own gather and mask; none padded here
                self.groups = [(self._token_rows(g, cu, device),
                                TorchAttentionPlan(_sub_layout(layout, g), device, group_of_step=True))
                               for g in groups]
                return
            self.kv_span = _contiguous_span(layout) if b == 1 else None
            if self.kv_span is None:
                gather = torch.zeros(b, self.max_kv, dtype=torch.long)
                for bi, (table, kv) in enumerate(zip(layout.block_tables, kv_lens)):
                    gather[bi, :kv] = page_slots(table, torch.arange(kv), layout.page_size)
                self.kv_gather = gather.view(-1).to(device)
        else:
            self.kv_gather = None
            # Cacheless (tree-masked: others are fresh) keys are the step's own tokens; key j
            # of request b is packed row cu[b]+j.
            gather = torch.zeros(b, self.max_kv, dtype=torch.long)
            for bi, kv in enumerate(kv_lens):
                gather[bi, :kv] = torch.arange(cu[bi], cu[bi] + kv)
            self.self_gather = gather.view(-1).to(device)
        mask = self._mask(layout)
        self.mask = None if mask is None else mask.to(device)

    @staticmethod
    def _token_rows(group: list[int], cu: list[int], device) -> torch.Tensor:
        """Packed rows [T_g] of the group's tokens, in the group's request order."""
        return torch.tensor([t for bi in group for t in range(cu[bi], cu[bi + 1])],
                            dtype=torch.long, device=device)

    def _mask(self, layout: BatchLayout) -> torch.Tensor | None:
        """[B, 1, max_q, max_kv] bool, True where query row i of request b may see key j."""
        b = self.batch
        if b == 1 and layout.is_decode:
            return None  # one request, one query: every cached key is visible, no padding.
        j = torch.arange(self.max_kv)
        i = torch.arange(self.max_q)
        q_lens = torch.tensor(layout.q_lens)
        kv_lens = torch.tensor(layout.kv_lens)
        ctx = (kv_lens - q_lens).view(b, 1, 1)
        key_ok = j.view(1, 1, -1) < kv_lens.view(b, 1, 1)
        causal = j.view(1, 1, -1) <= ctx + i.view(1, -1, 1)
        mask = key_ok & causal
        if layout.tree_masks is not None:
            for bi, tm in enumerate(layout.tree_masks):
                if tm is None:
                    continue
                q, kv, m = layout.q_lens[bi], layout.kv_lens[bi], tm.shape[1]
                mask[bi, :q, kv - m:kv] = tm.to(device="cpu", dtype=torch.bool)
        # Padded query rows see key 0 only, so SDPA never meets an all-false row (NaN).
        pad_rows = i.view(1, -1) >= q_lens.view(b, 1)
        mask[pad_rows] = j == 0
        return mask.unsqueeze(1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cache) -> torch.Tensor:
        t, heads, d = q.shape
        kvh = k.shape[1]
        b, mk = self.batch, self.max_kv
        if self.split is not None:
            out = q.new_empty(t, heads, d)
            for rows, sub in self.split:
                pick = lambda x: x.index_select(0, rows)  # noqa: E731
                out.index_copy_(0, rows, sub.attend(layer, pick(q), pick(k), pick(v), cache))
            return out
        if self.cached:
            kc, vc = cache.layer(layer)
            if self.paged is not None:
                if q.dtype == kc.dtype == torch.float32:  # paged_kernel: a CPU backend
                    # The kernel appends this step's rows itself.
                    return cpu_paged.paged_attention(q, k, v, self.slots, kc.view(-1, kvh, d),
                                                     vc.view(-1, kvh, d), *self.paged,
                                                     self.layout.page_size, self.threads or 1,
                                                     self.paged_masks)
                if not self.gathered:  # another dtype than the kernel's: the general path
                    self._plan_gathered()
            # 2-D row views: index ops on [slots, kvh * d] run ~2x faster than on 3-D.
            kc, vc = kc.view(-1, kvh * d), vc.view(-1, kvh * d)
            kc.index_copy_(0, self.slots, k.reshape(t, kvh * d))
            vc.index_copy_(0, self.slots, v.reshape(t, kvh * d))
            if self.causal_spans is not None:
                return self._attend_causal(q, k, v)
            if self.groups is not None:
                out = q.new_empty(t, heads, d)
                for rows, sub in self.groups:
                    out.index_copy_(0, rows, sub._attend_gathered(q.index_select(0, rows), kc, vc, kvh))
                return out
            return self._attend_gathered(q, kc, vc, kvh)
        if self.causal_spans is not None:
            return self._attend_causal(q, k, v)
        # Cacheless and not fresh: whole sequences under tree masks.
        keys = k.index_select(0, self.self_gather).view(b, mk, kvh, d)
        vals = v.index_select(0, self.self_gather).view(b, mk, kvh, d)
        return self._sdpa(q, keys, vals)

    def attend_latent(self, layer: int, q: torch.Tensor, latent: torch.Tensor, cache,
                      v_dim: int, scale: float) -> torch.Tensor:
        """MLA (absorbed): q [T, heads, D], latent rows [T, 1, D] -> [T, heads, v_dim]; the
        latent rows are keys and (first v_dim columns) values. See mla_torch.py."""
        return torch_attend_latent(self, layer, q, latent, cache, v_dim, scale)

    def _attend_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Fresh whole sequences: q [T, heads, d], k / v [T, kvh, d] packed -> [T, heads, d],
        one causal SDPA per sequence over its own rows."""
        heads, kvh = q.shape[1], k.shape[1]
        if self.cu_seqlens is not None and cpu_causal.applies(q, k):
            return cpu_causal.causal_attention(q, k, v, self.cu_seqlens, self.threads or 1)
        out = q.new_empty(q.shape)
        for s, e in self.causal_spans:
            # [1, heads, n, d] views of the packed rows; SDPA returns a new [1, heads, n, d].
            qs, ks, vs = (x[s:e].unsqueeze(0).transpose(1, 2) for x in (q, k, v))
            with torch_threads(self.threads if e - s >= LONG_ROWS else None):
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                   enable_gqa=heads != kvh)
            out[s:e] = o[0].transpose(0, 1)
        return out

    def _attend_gathered(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                         kvh: int) -> torch.Tensor:
        """q [T, heads, d] of this plan's requests; kc / vc: the layer's cache as [slots,
        kvh * d] rows, already holding this step's keys."""
        b, mk, d = self.batch, self.max_kv, q.shape[-1]
        if self.kv_span is not None:
            start, kv = self.kv_span
            return self._sdpa(q, kc[start:start + kv].view(1, kv, kvh, d),
                              vc[start:start + kv].view(1, kv, kvh, d))
        keys = kc.index_select(0, self.kv_gather).view(b, mk, kvh, d)
        vals = vc.index_select(0, self.kv_gather).view(b, mk, kvh, d)
        return self._sdpa(q, keys, vals)

    def _sdpa(self, q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        """q [T, heads, d] packed; keys / vals [B, max_kv, kvh, d] -> [T, heads, d]."""
        t, heads, d = q.shape
        b, mq, kvh = self.batch, self.max_q, keys.shape[2]
        if self.dense_q:
            qp = q.view(b, mq, heads, d)
        else:
            qp = q.new_zeros(b * mq, heads, d).index_copy_(0, self.q_rows, q).view(b, mq, heads, d)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
            attn_mask=self.mask, enable_gqa=heads != kvh)
        out = out.transpose(1, 2)  # [B, max_q, heads, d]
        if self.dense_q:
            return out.reshape(t, heads, d)
        return out.reshape(b * mq, heads, d).index_select(0, self.q_rows)


def _contiguous_span(layout: BatchLayout) -> tuple[int, int] | None:
    """(first slot, kv_len) if request 0's first kv_len cache entries sit in consecutive
    pages, else None."""
    kv, ps = layout.kv_lens[0], layout.page_size
    pages = layout.block_tables[0][:-(-kv // ps)]
    if any(p != pages[0] + i for i, p in enumerate(pages)):
        return None
    return pages[0] * ps, kv


def _paged_tables(layout: BatchLayout, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cpu_paged's inputs: block tables [B, max pages] int64 (the pages holding each
    request's kv_len keys, zero-padded), cu_q [B + 1], kv_lens [B]."""
    ps, kv_lens = layout.page_size, layout.kv_lens
    tables = [t[:-(-kv // ps)] for t, kv in zip(layout.block_tables, kv_lens)]
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    return (padded.to(device), torch.tensor(layout.cu_q(), dtype=torch.long, device=device),
            torch.tensor(kv_lens, dtype=torch.long, device=device))


def _split_mixed(layout: BatchLayout, device, threads: int | None, causal_kernel: bool
                 ) -> list[tuple[torch.Tensor, "TorchAttentionPlan"]] | None:
    """A step of whole fresh prompts beside decode-like requests (a prompt admitted while
    others decode: continuous batching, self-distillation's next turns) as two sub-plans,
    the prompts on the causal path and the rest on cpu_paged's kernel; None for any other
    step. As one plan such a step took the gathered path, every decode row padded to the
    longest prompt's query rows and a [B, max_q, max_kv] mask: SDPA over padding was 16% of
    a self-distillation run with next turns queued as answers ended (SmolLM2, 64 ShareGPT
    chats, 2 cores)."""
    q_lens, kv_lens = layout.q_lens, layout.kv_lens
    big = [i for i, q in enumerate(q_lens) if q > cpu_paged.SMALL_Q]
    if not big or len(big) == len(q_lens) or any(q_lens[i] != kv_lens[i] for i in big):
        return None
    small = [i for i in range(len(q_lens)) if q_lens[i] <= cpu_paged.SMALL_Q]
    cu = layout.cu_q()
    return [(TorchAttentionPlan._token_rows(g, cu, device),
             TorchAttentionPlan(_sub_layout(layout, g), device, threads=threads,
                                paged_kernel=True, causal_kernel=causal_kernel))
            for g in (big, small)]


def _sub_layout(layout: BatchLayout, group: list[int]) -> BatchLayout:
    """The layout of a subset of a step's requests (positions stay the parent's: rope is
    applied before attention, from the parent plan)."""
    pick = lambda xs: None if xs is None else [xs[i] for i in group]  # noqa: E731
    return BatchLayout(pick(layout.q_lens), pick(layout.kv_lens), pick(layout.block_tables),
                       layout.page_size, tree_masks=pick(layout.tree_masks))


class TorchAttentionBackend:
    name = "torch"
    graphs = None  # its steps' shapes follow the cache's lengths: no CUDA graphs

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        cpu = self.device.type == "cpu"
        self.threads = torch.get_num_threads() if cpu else None
        # Decode-like fp32 steps on CPU run cpu_paged's kernel where it can be built; built
        # (once per machine) or loaded here, so that no timed step ever pays for it.
        self.paged_kernel = cpu and cpu_paged.kernel() is not None
        # Steps of fresh whole sequences (precompute, prompt prefills): cpu_causal's kernel.
        self.causal_kernel = cpu and cpu_causal.kernel() is not None

    def plan(self, layout: BatchLayout) -> TorchAttentionPlan:
        return TorchAttentionPlan(layout, self.device, threads=self.threads,
                                  paged_kernel=self.paged_kernel,
                                  causal_kernel=self.causal_kernel)
