"""`DraftHead`: what every draft head shares: frozen target parts, rotary tables, the step
interface, its weight init and the training objective behind `forward`.

A head step maps (token ids [T], hidden input [T, H_in], ctx, draft step k) to (next hidden
[T, H], features [T, H]); features go through the lm_head to logits, the next hidden feeds
step k+1. The same `step` runs in training (heads/rollout.py, RolloutContext) and in the
engine (paged StepContext); heads with `attends = False` (Medusa) are handed ctx=None.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from heads.config import HeadConfig
from heads.frozen import FrozenHead, FrozenParts
from heads.objective import head_objective
from heads.transition import TransitionBias
from inference_eval.engine.model.arch import ModelArch
from inference_eval.engine.model.linear import matmul_wt
from inference_eval.engine.model.rope import arch_rope_tables


def head_arch(target: ModelArch, moe: bool = False, num_layers: int = 1) -> ModelArch:
    """The arch of a head's decoder layers (one unless num_layers says more): the target's
    attention (GQA, or MLA for DeepSeek) with, by default, a dense SwiGLU MLP of the target's
    intermediate_size (a DeepSeek target's routed experts dropped, even when its layer 0 is
    an MoE layer). moe: the one layer is an MoE layer with the target's experts, router and
    shared experts (layer 0 of a one-layer arch whose first_k_dense_replace is 0)."""
    if not moe:
        return replace(target, num_layers=num_layers, n_routed_experts=0)
    if target.n_routed_experts == 0:
        raise ValueError(f"head.moe=true: the target ({target.architecture}) has no routed "
                         "experts for the head's layer to copy; use head.moe=false (a dense MLP)")
    return replace(target, num_layers=1, first_k_dense_replace=0, moe_layer_freq=1)


class DraftHead(nn.Module):
    uses_tokens = True  # whether step() reads its token ids (Medusa: no)
    attends = True  # whether step() reads ctx, i.e. runs attention (Medusa: no; it gets None)
    # A reduced vocabulary (head.draft_vocab_size) keeps V_draft rows of the lm_head: EAGLE-3
    # trains its own copy of them; the other heads use the target's frozen rows as they are.
    trains_draft_lm_head = False
    # How the engine drafts with the head (inference_eval/evaluation/engines.py picks the
    # drafter): "chain" one step per draft, "parallel" all K steps of a round in one pass
    # (P-EAGLE), "block" one non-causal block pass (DFlash).
    drafting = "chain"

    def __init__(self, cfg: HeadConfig, parts: FrozenParts,
                 draft_vocab: torch.Tensor | None = None) -> None:
        """draft_vocab: the target ids [V_draft] of a reduced vocabulary (build_draft_vocab),
        required when cfg.draft_vocab_size is set."""
        super().__init__()
        self.cfg = cfg
        self.arch = head_arch(parts.arch, cfg.moe, cfg.num_layers)
        self.target_identity = parts.identity
        self.register_buffer("embed", parts.embed.detach(), persistent=False)
        self.frozen = FrozenHead(parts)
        a = self.arch
        cos, sin = arch_rope_tables(a)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.draft_lm_head = None  # EAGLE-3's own trained rows of a reduced vocabulary
        if cfg.draft_vocab_size is not None and (draft_vocab is None
                                                 or draft_vocab.numel() != cfg.draft_vocab_size):
            raise ValueError(f"head.draft_vocab_size={cfg.draft_vocab_size} needs its token "
                             "list (the draft vocabulary's target ids, heads.vocab.build_draft_vocab)")
        # A block drafter's in-block bias on d_k from d_{k-1} (heads/transition.py), or None.
        self.transition = None if not cfg.markov_rank else TransitionBias(
            a.vocab_size, None if cfg.draft_vocab_size is None else draft_vocab,
            cfg.markov_rank, parts.lm_head, any_prev=cfg.markov_first)
        if cfg.draft_vocab_size is None:
            self.draft_rows = None
            return
        self.register_buffer("d2t_ids", draft_vocab.long(), persistent=True)
        if self.trains_draft_lm_head:
            self.draft_lm_head = nn.Parameter(parts.lm_head.new_empty((draft_vocab.numel(),
                                                                       a.hidden_size)))
            self.draft_rows = None
        else:  # the target's frozen rows, gathered once: [V_draft, H]
            self.register_buffer("draft_rows", parts.lm_head[draft_vocab.long()].detach().clone(),
                                 persistent=False)

    # ---- the interface -------------------------------------------------------------------
    def first_hidden(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """Step-1 hidden input from the target: hidden [T, H] pre-norm, aux [T, A, H]."""
        return hidden

    def feature_target(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head's next hidden should match at a position (feature loss)."""
        return hidden

    def step(self, tokens: torch.Tensor, hidden_in: torch.Tensor, ctx,
             k: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft step k (1-based): tokens [T] (x_{t+k}), hidden_in [T, H_in] -> (next hidden
        [T, H] for step k+1, features [T, H] for the lm_head). ctx: the attention context
        (RolloutContext in training, StepContext in the engine); None when not `attends`."""
        raise NotImplementedError

    @property
    def decoder_layers(self) -> list[nn.Module]:
        """The head's decoder layers in order; layer i's keys and values are layer i of its
        KV cache (what tensor parallelism splits). Heads that attend have `layer`."""
        return [self.layer]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V_draft, H]: the frozen target lm_head, its rows of a reduced vocabulary, or the
        head's own trained rows (EAGLE-3)."""
        if self.draft_lm_head is not None:
            return self.draft_lm_head
        return self.frozen.weight if self.draft_rows is None else self.draft_rows

    def draft_to_target(self) -> torch.Tensor | None:
        """d2t as absolute ids [V_draft] for reduced vocabularies; None = identity."""
        return self.d2t_ids if self.cfg.draft_vocab_size is not None else None

    def logit_inputs(self, features: torch.Tensor, prev: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Training's (x, w, w_extra) of a draft's logits for soft_ce: (features [R, H], the
        lm_head weight, None); with the transition bias and prev [R] (each row's previous
        token), x widened by U[prev] [R, r] and w_extra = W [V_draft, r] (heads/transition.py).
        prev None: the head's plain logits."""
        if self.transition is None or prev is None:
            return features, self.lm_head_weight, None
        x, w_extra = self.transition.fold(features, prev)
        return x, self.lm_head_weight, w_extra

    packed = None  # the lm_head's exact block code for CPU inference (linear.set_cpu_blas)

    def packable_weight(self) -> torch.Tensor:
        return self.lm_head_weight

    def logits(self, features: torch.Tensor, cpu_blas: bool = False) -> torch.Tensor:
        """features [T, H] -> logits [T, V_draft] (target vocabulary unless reduced).
        cpu_blas: the engine's CPU inference path (inference_eval.engine.model.linear); its
        rows of the target's lm_head keep their block code (cpu_quant) there."""
        return matmul_wt(features, self.lm_head_weight.to(features.dtype), cpu_blas,
                         packed=self.packed if cpu_blas else None)

    def forward(self, batch, chunk: int = 1024, naive: bool = False):
        """Training objective over a packed batch -> (loss, stats [K, STATS]); see heads/objective.
        Routed through forward so DDP/FSDP/DeepSpeed wrappers see the call."""
        return head_objective(self, batch, chunk=chunk, naive=naive)

    # ---- weight init ----------------------------------------------------------------------
    def init_weights(self) -> None:
        """Initialize every trainable weight from the global generator, in named_parameters
        order (heads.registry.build_head seeds it, so a seed gives the same head), the
        transition bias's and confidence head's last: a head with them starts with its plain
        twin's other weights."""
        named = sorted(self.named_parameters(),
                       key=lambda kv: kv[0].startswith(("transition.", "confidence.")))
        with torch.no_grad():
            for name, p in named:
                if p.requires_grad:
                    self.init_parameter(name, p)

    def init_parameter(self, name: str, p: nn.Parameter) -> None:
        """The default: norms at 1, biases at 0, everything else normal(0, 0.02); heads
        override it for the parameters they start differently."""
        if name == "transition.prev":  # an embedding of the previous token (heads/transition)
            p.normal_(0.0, 1.0)
        elif name == "transition.out":  # zero: the head starts as it would without the bias
            p.zero_()
        elif name == "draft_lm_head":  # starts as the target's own rows of its draft vocabulary
            p.copy_(self.frozen.weight[self.d2t_ids])
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02)

    # ---- checkpoint helpers --------------------------------------------------------------
    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Only the weights training changes, and a reduced vocabulary's ids: what a head
        checkpoint stores."""
        state = {n: p.detach() for n, p in self.named_parameters() if p.requires_grad}
        if self.cfg.draft_vocab_size is not None:
            state["d2t_ids"] = self.d2t_ids
        return state

    def config_dict(self) -> dict:
        return {}

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T] -> E[tokens] [T, H] in the dtype of the head's own weights: in training
        the frozen table stays in the target's dtype (bf16) beside fp32 master weights
        (train/precision.py), and casting the gathered rows costs T x H, the table V x H."""
        return self.embed[tokens].to(self.frozen.norm.weight.dtype)
