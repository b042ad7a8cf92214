"""EAGLE-3: fused auxiliary target layers, a 2H-wide attention input, optional reduced vocab.

    step 1: g_t = fc([a1_t; a2_t; a3_t])   (A*H -> H) from the target's auxiliary layers
    later : g = the previous step's output
    x = [input_norm(E[x_{t+1}]); hidden_norm(g)]  (2H) -> attention; residual = g
    o = g + attn(x); o = o + mlp(post_norm(o))
    head.num_layers > 1: o = layer_i(o) for the plain decoder layers i = 1..N-1 after it
    logits = lm_head(final_norm(o)); o is the next step's g

The plain layers (`deep_layers`, checkpoint names deep_layers.{i-1}.*) are speculators'
multi-layer EAGLE-3 and P-EAGLE (whose published heads have several): each has its own keys
and values, layer i of the head's KV cache.

With draft_vocab_size set, the head has its own lm_head over the V_draft most frequent
loss-masked target tokens (t2d: target ids kept; d2t: draft id -> target id), initialized as
a copy of the target lm_head's rows for those tokens (`init_parameter`).

P-EAGLE (head.parallel_drafting): steps k >= 2 read the mask token and g = fc(mask_hidden),
a learned [A*H] stand-in for the target's states, instead of x_{t+k} and the previous step's
output. Step k still attends, causally by depth, to steps 1..k-1 at its position (the same
rollout attention), so a round's K drafts need no draft token: the engine runs them in one
pass (engine/speculative/block_drafters.py), and training fits every depth in one rollout.
"""
from __future__ import annotations

import torch
from torch import nn

from heads.base import DraftHead
from heads.config import HeadConfig, mask_token
from heads.frozen import FrozenParts
from inference_eval.engine.model.layers import DecoderLayer, RMSNorm
from inference_eval.engine.model.linear import Linear


class Eagle3Head(DraftHead):
    trains_draft_lm_head = True

    def __init__(self, cfg: HeadConfig, parts: FrozenParts, draft_vocab: torch.Tensor | None = None) -> None:
        super().__init__(cfg, parts, draft_vocab)
        a, h = self.arch, self.arch.hidden_size
        n_aux = max(len(cfg.aux_layers), 1)
        if not cfg.aux_layers:
            raise ValueError("head.type=eagle3 needs shards with auxiliary layers: precompute "
                             "with aux=eagle3 (head.aux_layers is read from the manifest)")
        self.fc = Linear(n_aux * h, h, bias=False)
        self.input_norm = RMSNorm(h, a.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, a.rms_norm_eps)
        self.layer = DecoderLayer(a, 0, input_norm=False, attn_in_features=2 * h)
        self.deep_layers = nn.ModuleList(DecoderLayer(a, i) for i in range(1, cfg.num_layers))
        self.final_norm = RMSNorm(h, a.rms_norm_eps)
        if cfg.parallel_drafting:
            self.mask_id = mask_token(cfg, a.vocab_size)
            self.mask_hidden = nn.Parameter(parts.lm_head.new_empty(n_aux * h))

    @property
    def decoder_layers(self) -> list[nn.Module]:
        return [self.layer, *self.deep_layers]

    @property
    def drafting(self) -> str:
        return "parallel" if self.cfg.parallel_drafting else "chain"

    def first_hidden(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        if aux is None:
            raise ValueError("EAGLE-3 needs aux_hidden in the shards (precompute aux=eagle3)")
        return self.fc(aux.reshape(aux.shape[0], -1))

    def step(self, tokens: torch.Tensor, hidden_in: torch.Tensor, ctx,
             k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer serves every draft step; k >= 2 of a P-EAGLE head reads the mask token
        and fc(mask_hidden) instead of tokens and hidden_in."""
        if k > 1 and self.cfg.parallel_drafting:
            return self.mask_step(tokens.shape[0], ctx)
        x = torch.cat([self.input_norm(self.embed_tokens(tokens)), self.hidden_norm(hidden_in)], -1)
        return self._rest(self.layer(x, ctx, residual=hidden_in), ctx)

    def mask_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """P-EAGLE: the input every step k >= 2 row shares -> (x [1, 2H], the mask token's
        normed embedding beside hidden_norm(g); g = fc(mask_hidden) [1, H], its residual)."""
        g = self.fc(self.mask_hidden.to(self.fc.weight.dtype).unsqueeze(0))
        tok = torch.full((1,), self.mask_id, dtype=torch.long, device=g.device)
        return torch.cat([self.input_norm(self.embed_tokens(tok)), self.hidden_norm(g)], -1), g

    def mask_step(self, n: int, ctx, inputs: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """n rows of steps k >= 2 -> (o [n, H], features [n, H]). inputs: mask_inputs(), which
        the engine computes once per drafter (its weights are fixed there), else now."""
        x, g = self.mask_inputs() if inputs is None else inputs
        o = self.layer(x.expand(n, -1).contiguous(), ctx, residual=g.expand(n, -1).contiguous())
        return self._rest(o, ctx)

    def _rest(self, o: torch.Tensor, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """The first layer's output [n, H] through the plain layers -> (o, final_norm(o))."""
        for layer in self.deep_layers:
            o = layer(o, ctx)
        return o, self.final_norm(o)

