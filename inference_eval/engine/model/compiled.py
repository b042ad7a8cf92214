"""Compiled small-row steps (decode, verification, draft steps) for CPU fp32 inference.

At batch 1 a step is a weight stream: ~540 MB of SmolLM2 weights per step whether it carries
1 or 5 rows. The products of a compiled step are the engine's own small-row kernel
(model/cpu_linear.py, a dispatcher op inductor calls as an external kernel), as in eager
steps: measured against inductor's CPU GEMM template (freezing packs every weight into its
blocked layout, a register-blocked micro-kernel per shape) it ties at 1 and 4 rows (a SmolLM2
decode step 16.4 vs 16.5 ms, 4 rows 20.7 vs 20.7), wins from 5 rows, where the template
needs a second pass over the weights (a step's products 19.9 ms vs 28.3), and halves the
compile (39 s vs 71 s for two row counts). What the compile is for is the step's small ops
(rope on q and k, norms, SwiGLU, residuals), ~100 aten calls per layer eagerly, fused.
Where the kernel cannot be built, the products stay F.linear and inductor's template
(INDUCTOR_CONFIG) takes them.

What is compiled: embedding -> every decoder layer -> final norm -> lm_head, for one row
count T at a time (inductor specializes its GEMM on the rows, so each T is its own compile).
Only the counts `warm` compiled run compiled, so no compile ever lands inside a timed run
and a prompt that happens to be short never triggers one; other steps run eagerly. Attention stays the
backend's own eager code: the graph calls it through one opaque custom op
(`specheads::step_attend`), which reads the step's plan and cache from the active
`StepContext`, so paging, plans and the KV cache are exactly the eager path's. Prefill (many
rows, GEMM-bound, one row of logits) keeps the eager OpenBLAS path.

Applies to dense GQA architectures (the Llama family); MLA and MoE layers run eagerly.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterable, Sequence

import torch
import torch._inductor.config as inductor_config
from torch import nn

from inference_eval.engine.attention.layout import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionPlan
from inference_eval.engine.threads import torch_threads

# Inductor settings, applied around the calls of `warm` (a compile happens lazily inside one;
# passed as torch.compile(options=...) freezing is not applied): freezing turns weights into
# constants it may pre-pack, max_autotune with the CPP backend alone selects its GEMM
# template without benchmarking alternatives (seconds per shape in every compile).
INDUCTOR_CONFIG = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP",
                   # A size/stride and an alignment check after each of a step's ~150 external
                   # calls (products, attention): ~0.1 ms a SmolLM2 step (cProfile of an eval)
                   # for shapes the graph fixes.
                   "size_asserts": False, "alignment_asserts": False}

def _cache_kernel_templates() -> None:
    """Inductor re-parses the same jinja source for every GEMM it renders (~120 per SmolLM2
    step: a third of a compile in cProfile); parsed templates are immutable, so parse each
    source once. A no-op where torch has no such hook or already caches it."""
    from torch._inductor.codegen.common import KernelTemplate

    f = KernelTemplate.__dict__.get("_template_from_string")
    if isinstance(f, staticmethod) and not hasattr(f.__func__, "cache_info"):
        KernelTemplate._template_from_string = staticmethod(functools.lru_cache(maxsize=None)(f.__func__))


try:  # torch.compiler.set_stance's own hook (its public context manager costs ~50 us to enter)
    from torch._dynamo.eval_frame import DynamoStance as _Stance, _set_stance as _SET_STANCE

    _ROW_GUARDS_ONLY = _Stance("default", skip_guard_eval_unsafe=True)
except ImportError:  # a torch without it: every guard is checked
    _SET_STANCE = _ROW_GUARDS_ONLY = None


@contextlib.contextmanager
def _checking_only_row_guards():
    """Dynamo checks only the guards that tell this code's compiled graphs apart (their row
    counts) instead of all of them (each global and module attribute the step reads, for each
    cached graph in turn: ~65 us of a SmolLM2 step, a twentieth of a draft step): the graphs'
    weights are frozen constants and nothing they read changes after `warm`. What
    torch.compiler.set_stance(skip_guard_eval_unsafe=True) does, at ~1 us."""
    if _SET_STANCE is None:
        yield
        return
    prior = _SET_STANCE(_ROW_GUARDS_ONLY)
    try:
        yield
    finally:
        _SET_STANCE(prior)


_ACTIVE: list = []  # the StepContext of the step being run (a stack: heads run inside steps)


def _step_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """The active step's attention (appends k/v to its cache): q [T, heads, d], k/v
    [T, kv_heads, d] -> [T, heads, d]."""
    return _ACTIVE[-1].attend(layer, q, k, v).contiguous()


# A plain dispatcher op rather than torch.library.custom_op, whose wrapper cost ~4 us a call
# (SmolLM2's decode attention through the op: 21.4 vs 17.0 us, measured), 30 calls a step.
_LIB = torch.library.Library("specheads", "FRAGMENT")
_LIB.define("step_attend(Tensor q, Tensor k, Tensor v, int layer) -> Tensor")
_LIB.impl("step_attend", _step_attend, "CompositeExplicitAutograd")
torch.library.register_fake("specheads::step_attend")(lambda q, k, v, layer: torch.empty_like(q))
step_attend = torch.ops.specheads.step_attend


class _GraphContext:
    """What a layer reads of its step inside the compiled graph: rotary rows and an attend
    that defers to the active StepContext."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos, self.sin = cos, sin

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return step_attend(q, k, v, layer)


class _Step(nn.Module):
    """A TransformerLM step: (input_ids [T], cos/sin [T, rope_dim]) -> (logits [T, V] fp32,
    hidden [T, H], aux [T, A, H] or None)."""

    def __init__(self, model: nn.Module, aux_layers: tuple[int, ...]) -> None:
        super().__init__()
        self.model, self.aux_layers = model, aux_layers

    def forward(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        m, ctx = self.model, _GraphContext(cos, sin)
        x = m.embed_tokens(input_ids)
        aux = [None] * len(self.aux_layers)  # in the order the caller lists them
        for i, layer in enumerate(m.layers):
            x = layer(x, ctx)
            if i in self.aux_layers:
                aux[self.aux_layers.index(i)] = x
        logits = m.compute_logits(x)
        return logits, x, (torch.stack(aux, dim=1) if aux else None)


class _HeadStep(nn.Module):
    """A draft head's step (heads.DraftHead; attending heads do not read the step index):
    (tokens [T], state [T, H_in], cos/sin [T, rope_dim]) -> (next state [T, H], logits
    [T, V_draft] fp32 in the head's own vocabulary)."""

    def __init__(self, head: nn.Module, variant: tuple[int, ...] = ()) -> None:
        super().__init__()  # variant (the state width) only keys the graph; shapes carry it
        self.head = head

    def forward(self, tokens: torch.Tensor, state: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor):
        nxt, feats = self.head.step(tokens, state, _GraphContext(cos, sin), k=1)
        return nxt, self.head.logits(feats, cpu_blas=True).float()


def dense_attending(model: nn.Module) -> bool:
    """A TransformerLM or draft head whose layers are dense GQA (a head: one attending
    layer): what the step graphs here (and CUDA graphs, model/cuda_graphs.py) can run."""
    a = model.arch
    return (not a.is_mla and not any(a.is_moe_layer(i) for i in range(a.num_layers))
            and getattr(model, "attends", True))


def compilable(model: nn.Module) -> bool:
    """Whether a TransformerLM or a draft head can run compiled: CPU fp32 weights, dense
    GQA layers."""
    w = model.lm_head_weight
    return w.device.type == "cpu" and w.dtype == torch.float32 and dense_attending(model)


class _RowCompiled:
    """One compiled graph per (variant, row count), compiled only by `warm`."""

    graph: type[nn.Module]

    def __init__(self, module: nn.Module, max_rows: int = 16) -> None:
        if not compilable(module):
            raise ValueError("compiled steps need a CPU fp32 model with dense GQA layers "
                             "(set engine.compile=false for this model)")
        self.module, self.max_rows = module, max_rows
        _cache_kernel_templates()
        self.threads = torch.get_num_threads()  # the kernels' OpenMP width is fixed at compile
        self._fns: dict[tuple[int, ...], object] = {}
        self.rows: set[tuple[tuple[int, ...], int]] = set()  # (variant, T) warm() compiled
        # One graph per row count and variant, and every instance compiles the same code
        # objects anew (an eval builds an engine, with its own head, per run and pass): raise
        # dynamo's per-code-object and total limits by what this instance may add, or a long
        # eval stops on them (fullgraph=True fails where dynamo would fall back to eager).
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, 8) + 4 * max_rows
        if hasattr(cfg, "accumulated_recompile_limit"):
            cfg.accumulated_recompile_limit += 4 * max_rows

    def ready(self, num_tokens: int, variant: tuple[int, ...] = ()) -> bool:
        """Whether a step of this many rows runs compiled: warmed, and inference (no grad)."""
        return (variant, num_tokens) in self.rows and not torch.is_grad_enabled()

    def _run(self, variant: tuple[int, ...], ctx, *args, compiling: bool = False):
        fn = self._fns.get(variant)
        if fn is None:
            # Dynamo's guards on every module attribute cost ~1 ms per call here (a third of
            # a draft step); the graph's weights are frozen constants and its modules are
            # never mutated after `warm`, so only the input tensors' guards are kept.
            fn = self._fns[variant] = torch.compile(
                self.graph(self.module, variant), dynamic=False, fullgraph=True,
                options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
        _ACTIVE.append(ctx)
        try:
            if not compiling:
                try:
                    with torch_threads(self.threads), _checking_only_row_guards():
                        return fn(*args, ctx.cos, ctx.sin)
                except RuntimeError as exc:  # raised at the guards, before the graph ran
                    if "skip_guard_eval_unsafe" not in str(exc):
                        raise
                    # Inputs unlike warm's (tensors made outside inference mode): compiled
                    # for them below, as dynamo would have done checking every guard.
            # The settings matter only where inductor compiles; patching them costs ~24 us.
            with torch_threads(self.threads), inductor_config.patch(INDUCTOR_CONFIG):
                return fn(*args, ctx.cos, ctx.sin)
        finally:
            _ACTIVE.pop()

    def warm(self, rows: Iterable[int], variant: tuple[int, ...] = ()) -> None:
        """Compile the given row counts (at most max_rows) now, each with a throwaway causal
        step (no cache written); from then on steps of these counts run compiled."""
        from inference_eval.engine.model.transformer import StepContext

        m = self.module
        with torch.inference_mode():
            for t in sorted(set(rows)):
                if t > self.max_rows or (variant, t) in self.rows:
                    continue
                plan = TorchAttentionPlan(BatchLayout.packed([t]), m.lm_head_weight.device)
                ctx = StepContext(m.rope_cos[plan.positions], m.rope_sin[plan.positions], plan, None)
                self._run(variant, ctx, *self._example(t, plan.positions.device, variant),
                          compiling=True)
                self.rows.add((variant, t))

    def _example(self, t: int, device, variant) -> tuple[torch.Tensor, ...]:
        """Inputs of a throwaway step of t rows (besides cos/sin)."""
        raise NotImplementedError


class CompiledSteps(_RowCompiled):
    """The compiled steps of one TransformerLM (variant: the aux layers a step returns)."""

    graph = _Step

    def applies(self, num_tokens: int, logits_indices: torch.Tensor | None,
                compute_logits: bool, aux_layers: tuple[int, ...] = ()) -> bool:
        """Warmed, and logits wanted for every row (decode, verification), not only a
        prefill's last row."""
        return (compute_logits and self.ready(num_tokens, aux_layers)
                and (logits_indices is None or logits_indices.numel() == num_tokens))

    def __call__(self, input_ids: torch.Tensor, ctx, aux_layers: Sequence[int] = ()):
        """input_ids [T]; ctx: the step's StepContext (plan, cache, rotary rows) ->
        (logits [T, V] fp32, hidden [T, H], aux [T, A, H] or None)."""
        return self._run(tuple(aux_layers), ctx, input_ids)

    def _example(self, t, device, variant):
        return (torch.zeros(t, dtype=torch.long, device=device),)


class CompiledHeadSteps(_RowCompiled):
    """The compiled steps of one attending draft head (MTP, EAGLE-1/3); variant: the width
    of the state it reads (EAGLE-3's first step reads fused target layers, later steps its
    own hidden state)."""

    graph = _HeadStep

    def applies(self, num_tokens: int, state: torch.Tensor) -> bool:
        return self.ready(num_tokens, (state.shape[-1],))

    def __call__(self, tokens: torch.Tensor, state: torch.Tensor, ctx):
        """tokens [T], state [T, H_in] -> (next state [T, H], logits [T, V_draft] fp32)."""
        return self._run((state.shape[-1],), ctx, tokens, state)

    def _example(self, t, device, variant):
        return (torch.zeros(t, dtype=torch.long, device=device),
                torch.zeros(t, variant[0], device=device))
