"""CUDA graphs of the engine's small GPU steps: decode, chain verification, draft steps.

At batch 1 a small model's GPU step is host work, not arithmetic: SmolLM2's step issues ~15
kernels per layer from Python (an H200 took 26 ms for its ~0.3 GFLOP), so verifying K + 1
tokens costs what decoding one does and a draft step is a large fraction of either. A CUDA
graph records a step's kernels once and replays them with one launch.

What is graphed: a step of a TransformerLM (embedding -> layers -> final norm -> lm_head, all
rows' logits) or of an attending draft head (its layer and lm_head), through the same graph
modules that model/compiled.py compiles for CPU (attention through the `step_attend` op), on
a FlashInfer plan with a page table and no custom mask: decode steps (1 row a request), chain
verification, head refills and head draft steps. Tree-masked steps, prefills of more than
MAX_TOKENS rows, MLA and MoE models run eagerly.

One graph per (module, KV cache, state width or aux layers, step kind, q_lens). The q_lens
are part of the key, so the FlashInfer planning a graph was captured under describes the
shape of every replay; only the page table and the key/value lengths change between replays,
and FlashInfer's CUDA-graph wrappers keep those in fixed device buffers that each plan
rewrites. A graph is captured the first time its key runs (that run is the eager step
itself), at most MAX_GRAPHS per engine (then steps run eagerly).

A replay copies the step's inputs, rotary rows and cache slots into the graph's own buffers,
plans its wrapper with the step's page table (once per plan: the target's verification and
the head's refill on the same plan share a wrapper when their shapes match), replays, and
clones the outputs (all graphs of an engine share one memory pool, so one graph's outputs
are another's scratch). Outputs are the eager step's up to FlashInfer's split-KV order in
the attention sums (its CUDA-graph plans always split; bf16 rounding), tested on GPU.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from inference_eval.engine.attention.flashinfer_backend import (
    append_kv, plan_wrapper, tensor_core_decode)
from inference_eval.engine.model.compiled import _ACTIVE, _HeadStep, _Step, dense_attending
from inference_eval.engine.model.transformer import StepContext

MAX_TOKENS = 256  # rows of the largest graphed step (batch x rows per request)
# Rows one request may have in a graphed step: decode, verification and refills after a
# round; a prompt's prefill (and the head's refill over it) has a new length every time,
# so graphing it would capture one graph per prompt.
MAX_REQUEST_ROWS = 16
MAX_GRAPHS = 64  # each FlashInfer wrapper holds 16 MB of int workspace (8 of it pinned host)


class _GraphPlan:
    """The attention plan inside a graph: the graph's own slot buffer and wrapper."""

    def __init__(self, wrapper, slots: torch.Tensor, positions: torch.Tensor) -> None:
        self.wrapper, self.slots, self.positions = wrapper, slots, positions
        self.num_tokens = slots.numel()

    def attend(self, layer, q, k, v, cache):
        return self.wrapper.run(q, append_kv(cache, layer, self.slots, k, v))


class DeviceGraph:
    """torch.cuda.CUDAGraph capture and replay (tests substitute a CPU stand-in)."""

    def __init__(self, pool, stream: torch.cuda.Stream) -> None:
        self.pool, self.stream, self.graph = pool, stream, torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], tuple]) -> tuple:
        # One run on the capture stream first (lazy library state, e.g. cuBLAS workspaces,
        # must exist before capture); it rewrites the cache slots the step just wrote with
        # the same values.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        with torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


@dataclass
class _Entry:
    graph: DeviceGraph
    inputs: tuple[torch.Tensor, ...]
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    wrapper_key: tuple
    outputs: tuple


class CudaGraphs:
    """An engine's CUDA graphs (set as its FlashInfer backend's `graphs`; every plan of that
    backend carries it). `captures` / `replays` count what ran as graphs."""

    def __init__(self, backend, max_graphs: int = MAX_GRAPHS, graph_factory=None) -> None:
        # The backend holds this registry; a weak reference back keeps the two from a cycle
        # that would hold a dropped engine's cache and graphs until a cyclic collection.
        self._backend, self.max_graphs = weakref.ref(backend), max_graphs
        self._factory = graph_factory
        self.entries: dict[tuple, _Entry] = {}
        self._modules: dict[tuple, nn.Module] = {}  # (module, variant) -> graph module
        self._wrappers: dict[tuple, object] = {}
        self._planned: dict[tuple, int] = {}  # wrapper key -> id of the plan it holds
        self.captures = self.replays = 0
        self._pool = self._stream = None  # made with the first real CUDA graph

    # ---- the two kinds of step ---------------------------------------------------------
    def model_step(self, model: nn.Module, input_ids: torch.Tensor, ctx, cache,
                   aux_layers: tuple[int, ...]):
        """A TransformerLM step: input_ids [T] -> (logits [T, V] fp32, hidden [T, H], aux
        [T, A, H] or None), or None where this step is not graphed."""
        return self._step(model, aux_layers, lambda: _Step(model, aux_layers), ctx, cache,
                          (input_ids,))

    def head_step(self, head: nn.Module, tokens: torch.Tensor, state: torch.Tensor, ctx, cache):
        """A draft head's step: tokens [T], state [T, H_in] -> (next state [T, H], logits
        [T, V_draft] fp32), or None where this step is not graphed."""
        return self._step(head, (state.shape[-1],), lambda: _HeadStep(head), ctx, cache,
                          (tokens, state))

    # ---- capture and replay -------------------------------------------------------------
    def _step(self, module, variant, make_module, ctx, cache, inputs):
        plan = ctx.plan
        if not self._applies(plan):
            return None
        # The module and cache themselves (hashed by identity) key the graph: held here,
        # they outlive every graph that writes to them.
        key = (module, cache, variant, plan.kind, tuple(plan.layout.q_lens))
        e = self.entries.get(key)
        if e is None:
            if len(self.entries) >= self.max_graphs or not dense_attending(module):
                return None
            return self._capture(key, module, variant, make_module, ctx, cache, inputs)
        for dst, src in zip(e.inputs, inputs):
            dst.copy_(src)
        e.cos.copy_(ctx.cos)
        e.sin.copy_(ctx.sin)
        e.slots.copy_(plan.slots)
        self._plan(e.wrapper_key, plan)
        e.graph.replay()
        self.replays += 1
        return tuple(None if o is None else o.clone() for o in e.outputs)

    def _applies(self, plan) -> bool:
        # Under inference mode only: the graphs' buffers are inference tensors.
        return (getattr(plan, "graphs", None) is self and plan.cached
                and plan.kind in ("decode", "paged") and plan.custom_mask is None
                and plan.num_tokens <= MAX_TOKENS and max(plan.layout.q_lens) <= MAX_REQUEST_ROWS
                and torch.is_inference_mode_enabled())

    def _capture(self, key, module, variant, make_module, ctx, cache, inputs):
        plan, arch = ctx.plan, module.arch
        if (module, variant) not in self._modules:
            self._modules[module, variant] = make_module()
        graph_module = self._modules[module, variant]
        heads, kv_heads = arch.num_heads, arch.num_kv_heads
        tc = plan.kind == "decode" and tensor_core_decode(heads, kv_heads)
        wkey = (plan.kind, tc, len(plan.layout.q_lens), plan.num_tokens, heads, kv_heads,
                arch.head_dim, cache.k.dtype, cache.page_size, cache.num_pages)
        if wkey not in self._wrappers:
            self._wrappers[wkey] = self._backend().graph_wrapper(
                plan.kind, len(plan.layout.q_lens), cache.num_pages, tc)
        self._plan(wkey, plan)
        static = tuple(t.clone() for t in inputs)
        cos, sin, slots = ctx.cos.clone(), ctx.sin.clone(), plan.slots.clone()
        gctx = StepContext(cos, sin, _GraphPlan(self._wrappers[wkey], slots, plan.positions), cache)

        def run():
            _ACTIVE.append(gctx)
            try:
                return graph_module(*static, cos, sin)
            finally:
                _ACTIVE.pop()

        out = run()  # the step itself
        graph = self._new_graph()
        outputs = graph.capture(run)
        self.entries[key] = _Entry(graph, static, cos, sin, slots, wkey, outputs)
        self.captures += 1
        return out

    def _plan(self, wkey: tuple, plan) -> None:
        if self._planned.get(wkey) == plan.id:
            return
        kind, _, _, _, heads, kv_heads, d, dtype, page_size, _ = wkey
        plan_wrapper(self._wrappers[wkey], kind, plan.meta_host, heads, kv_heads, d, page_size,
                     dtype)
        self._planned[wkey] = plan.id

    def _new_graph(self):
        if self._factory is not None:
            return self._factory()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream()
        return DeviceGraph(self._pool, self._stream)
