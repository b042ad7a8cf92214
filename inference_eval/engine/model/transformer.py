"""The engine's decoder-only language model (target, or a small LLM used as draft)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from inference_eval.engine.attention.plan import AttentionPlan
from inference_eval.engine.kv_cache import KVCache
from inference_eval.engine.model.arch import ModelArch
from inference_eval.engine.model.layers import DecoderLayer, RMSNorm
from inference_eval.engine.model.linear import Linear, matmul_wt
from inference_eval.engine.model.rope import arch_rope_tables


@dataclass
class ModelOutput:
    """logits [N, V] fp32 for the requested rows (None when skipped); hidden [T, H] is the
    last decoder layer's output BEFORE the final norm; aux [T, A, H] the chosen layers' outputs."""

    logits: torch.Tensor | None
    hidden: torch.Tensor
    aux: torch.Tensor | None = None


class StepContext:
    """Binds one step's attention plan to one model's rotary tables and KV cache."""

    __slots__ = ("cos", "sin", "plan", "cache")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, plan: AttentionPlan,
                 cache: KVCache | None) -> None:
        self.cos, self.sin, self.plan, self.cache = cos, sin, plan, cache

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.plan.attend(layer, q, k, v, self.cache)

    def attend_latent(self, layer: int, q: torch.Tensor, latent: torch.Tensor, v_dim: int,
                      scale: float) -> torch.Tensor:
        """MLA: q [T, heads, D], latent rows [T, 1, D] -> [T, heads, v_dim]."""
        return self.plan.attend_latent(layer, q, latent, self.cache, v_dim, scale)


class TransformerLM(nn.Module):
    """Embedding, `num_layers` shared decoder layers, final RMSNorm, lm_head (tied or not).
    Rotary tables cover `arch.rope_dim` (the decoupled rotary key width under MLA)."""

    cpu_blas: bool = False  # see model/linear.py; engines switch it on for CPU fp32
    compiled = None  # model/compiled.CompiledSteps when an engine compiles its small-row steps
    packed = None  # the tied lm_head's exact block code (linear.set_cpu_blas; cpu_quant)

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = None if arch.tie_word_embeddings else Linear(
            arch.hidden_size, arch.vocab_size, bias=False)
        cos, sin = arch_rope_tables(arch)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H]: the output projection (the embedding when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def packable_weight(self) -> torch.Tensor | None:
        """The tied lm_head (an untied one is a Linear, which packs itself)."""
        return self.embed_tokens.weight if self.lm_head is None else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] pre-norm -> logits [N, V] fp32."""
        if self.lm_head is not None:
            return self.lm_head(self.norm(hidden)).float()
        return matmul_wt(self.norm(hidden), self.lm_head_weight, self.cpu_blas,
                         packed=self.packed).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        plan: AttentionPlan,
        cache: KVCache | None = None,
        *,
        logits_indices: torch.Tensor | None = None,
        compute_logits: bool = True,
        aux_layers: Sequence[int] = (),
    ) -> ModelOutput:
        """input_ids [T] int64 packed over the step's requests; `plan.positions` [T].

        logits_indices [N] selects the rows that need logits (e.g. each request's last token);
        None means all T rows. compute_logits=False skips lm_head entirely (precompute).
        aux_layers: 0-based layer ids whose outputs are returned in `aux` [T, A, H].
        """
        positions = plan.positions
        ctx = StepContext(self.rope_cos[positions], self.rope_sin[positions], plan, cache)
        # A whole step as one graph (every row's logits): compiled on CPU, a CUDA graph on GPU.
        c, g, got = self.compiled, getattr(plan, "graphs", None), None
        if c is not None and c.applies(input_ids.shape[0], logits_indices, compute_logits,
                                       tuple(aux_layers)):
            got = c(input_ids, ctx, tuple(aux_layers))
        elif g is not None and compute_logits and (logits_indices is None
                                                   or logits_indices.numel() == input_ids.shape[0]):
            got = g.model_step(self, input_ids, ctx, cache, tuple(aux_layers))
        if got is not None:
            logits, x, aux = got
            if logits_indices is not None:
                logits = logits.index_select(0, logits_indices)
            return ModelOutput(logits=logits, hidden=x, aux=aux)
        x = self.embed_tokens(input_ids)
        want = {layer: j for j, layer in enumerate(aux_layers)}
        aux = [None] * len(want)
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx)
            if i in want:
                aux[want[i]] = x
        logits = None
        if compute_logits:
            rows = x if logits_indices is None else x.index_select(0, logits_indices)
            logits = self.compute_logits(rows)
        return ModelOutput(logits=logits, hidden=x, aux=torch.stack(aux, dim=1) if aux else None)
