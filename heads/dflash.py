"""DFlash: a few decoder layers that fill a block of mask tokens in one non-causal pass,
reading the target's multi-layer states as injected context.

    c_j = hidden_norm(fc([a1_j; ...; aA_j]))        (A*H -> H) target aux states at position j
    block of an anchor at n: tokens [x_n, m, ..., m] (B = num_steps + 1 rows, m = mask token)
    x = E[block]                                    (frozen target embedding)
    every layer l: keys/values = [k_l(c_j), v_l(c_j) for j < n ; the block's own k, v]
                   (the layer's own k/v projections, k norm and rope at j), queries = block
                   rows; bidirectional inside the block, causal to the context
    logits of row i >= 1 = lm_head(final_norm(x_i)) predict x_{n+i}    (frozen lm_head rows)

| block row i | token | rope position | predicts | soft label | valid when          |
|-------------|-------|---------------|----------|------------|---------------------|
| 0           | x_n   | n             | -        | -          | -                   |
| i >= 1      | m     | n + i         | x_{n+i}  | p_{n+i-1}  | loss_mask[n+i]      |

So draft d_i of a round is row i and K = B - 1 drafts come from one pass. The layers use the
target's attention shapes with q/k norms (DFlash's and speculators' Qwen3-style layer: the
normed keys keep the injected states and the block rows on one scale), a dense MLP.
Training (heads/block_objective.py) samples random anchors per sequence; the engine keeps the
context keys/values of the verified positions in the draft's own paged cache
(engine/speculative/block_drafters.py).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from heads.base import DraftHead
from heads.block_attention import BlockContext, BlockPlan
from heads.config import HeadConfig, mask_token
from heads.frozen import FrozenParts
from inference_eval.engine.model.layers import Attention, DecoderLayer, RMSNorm
from inference_eval.engine.model.linear import Linear
from inference_eval.engine.model.rope import apply_rope


def context_kv(attn: Attention, c: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a layer's attention makes of injected context states: c [T, H],
    cos / sin [T, head_dim] of their positions -> k, v [T, kv_heads, head_dim] (k normed and
    rotated as the layer's own keys are). Only the k/v rows of the fused projection run."""
    t, q = c.shape[0], attn.q_size
    w, b = attn.qkv_proj.weight[q:], attn.qkv_proj.bias
    kv = F.linear(c, w.to(c.dtype), None if b is None else b[q:].to(c.dtype))
    k, v = kv.split([attn.kv_size, attn.kv_size], dim=-1)
    k = k.reshape(t, attn.kv_heads, attn.head_dim)
    if attn.k_norm is not None:
        k = attn.k_norm(k)
    return apply_rope(k, cos, sin), v.reshape(t, attn.kv_heads, attn.head_dim)


class DFlashHead(DraftHead):
    drafting = "block"  # the engine drafts a whole block per pass (evaluation/engines.py)

    def __init__(self, cfg: HeadConfig, parts: FrozenParts,
                 draft_vocab: torch.Tensor | None = None) -> None:
        super().__init__(cfg, parts, draft_vocab)
        if parts.arch.is_mla:
            raise ValueError("head.type=dflash needs a grouped-query attention target; "
                             f"{parts.arch.architecture} uses latent attention (use head=mtp)")
        if not cfg.aux_layers:
            raise ValueError("head.type=dflash reads the target's auxiliary layers: precompute "
                             "with aux=eagle3 (head.aux_layers is read from the manifest)")
        a = replace(parts.arch, num_layers=cfg.num_layers, n_routed_experts=0, qk_norm=True)
        self.arch, h = a, a.hidden_size
        self.mask_id = mask_token(cfg, a.vocab_size)
        # Fixed here: the loop and validation may set cfg.num_steps (a chain's depth) later,
        # but a block of another size is another model.
        self._block = cfg.num_steps + 1
        self.fc = Linear(len(cfg.aux_layers) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, a.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(a, i) for i in range(cfg.num_layers))
        self.final_norm = RMSNorm(h, a.rms_norm_eps)
        # DSpark's confidence head: [features ; U[prev]] -> the draft's acceptance logit. Built
        # without drawing (init_weights draws it last), so a head with it keeps its plain
        # twin's other weights for the same seed.
        self.confidence = None if not cfg.confidence_head else nn.utils.skip_init(
            nn.Linear, h + cfg.markov_rank, 1, bias=True)

    @property
    def decoder_layers(self) -> list[nn.Module]:
        return list(self.layers)

    @property
    def block_size(self) -> int:
        """B: the anchor row and K mask rows (head.num_steps when built)."""
        return self._block

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [T, A, H] (target aux layer outputs) -> injected context states c [T, H]."""
        if aux is None:
            raise ValueError("DFlash needs aux_hidden in the shards (precompute aux=eagle3)")
        x = aux.reshape(aux.shape[0], -1).to(self.hidden_norm.weight.dtype)
        return self.hidden_norm(self.fc(x))

    def layer_context_kv(self, layer: int, c: torch.Tensor, positions: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft layer `layer`'s keys and values of context states c [T, H] at rotary
        positions [T] -> k, v [T, kv_heads, head_dim] (what the engine caches)."""
        return context_kv(self.layers[layer].self_attn, c, self.rope_cos[positions],
                          self.rope_sin[positions])

    def confidence_logit(self, features: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """features [R, H] of draft rows, prev [R] the token before each draft (row 1's: the
        anchor) -> [R] logits of the drafts' predicted acceptance (the confidence head). It
        reads the bias's U[prev] detached: only the confidence head learns from its loss."""
        x = features
        if self.transition is not None:
            x = torch.cat([x, self.transition.embed(prev).detach().to(x.dtype)], -1)
        return self.confidence(x.to(self.confidence.weight.dtype)).squeeze(-1)

    def block_tokens(self, last: torch.Tensor) -> torch.Tensor:
        """last [J] (each block's anchor token) -> [J * B]: the anchor, then B-1 mask ids."""
        out = torch.full((last.shape[0], self.block_size), self.mask_id, dtype=torch.long,
                         device=last.device)
        out[:, 0] = last
        return out.view(-1)

    def block_features(self, tokens: torch.Tensor, ctx,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [J * B] (block_tokens) -> features [J * B, H] for the lm_head, or [R, H]
        of rows [R] only (the engine's mask rows: the last layer then runs its o_proj and
        MLP on those rows alone). ctx: the block rows' attention (BlockContext in training,
        a paged StepContext in the engine, whose cache already holds the context keys)."""
        x = self.embed_tokens(tokens)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, rows=rows if i == last else None)
        return self.final_norm(x)

    def train_blocks(self, hidden_aux: torch.Tensor, seq_lens: list[int], input_ids: torch.Tensor,
                     anchors: torch.Tensor) -> torch.Tensor:
        """Training form: hidden_aux [N, A, H] of a packed batch, input_ids [N], anchors [J]
        (global packed indices, ascending) -> features [J, B, H]."""
        c = self.context(hidden_aux)
        plan = BlockPlan(seq_lens, anchors, self.block_size, c.device)
        kv = [self.layer_context_kv(i, c, plan.ctx_positions) for i in range(len(self.layers))]
        ctx = BlockContext(plan, self.rope_cos[plan.positions], self.rope_sin[plan.positions], kv)
        feats = self.block_features(self.block_tokens(input_ids[anchors]), ctx)
        return feats.view(anchors.shape[0], self.block_size, -1)

    # ---- the interface of chain heads, which a block head does not have -------------------
    def first_hidden(self, hidden, aux):
        raise TypeError("a DFlash head drafts blocks: it has no per-step hidden input "
                        "(use train_blocks / the block drafter)")

    def step(self, tokens, hidden_in, ctx, k=1):
        raise TypeError("a DFlash head drafts blocks, not chain steps (use block_features)")

    def forward(self, batch, chunk: int = 1024, naive: bool = False):
        """Training objective over a packed batch -> (loss, stats [K, STATS]): random anchors
        while training, every anchor (deterministic) in eval mode (heads/block_objective)."""
        from heads.block_objective import block_objective

        return block_objective(self, batch, chunk=chunk, naive=naive)
