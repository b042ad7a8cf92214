"""Speculative decoding under tensor parallelism: a draft head split with the target.

What each rank holds (T ranks; the head is built whole from its checkpoint on every rank,
then `ShardedHead` keeps the rank's part, as tp.parallelize does for the target):

| part | form | communication per head call |
|---|---|---|
| the head's decoder layers (MTP, EAGLE-1/3, P-EAGLE: one, EAGLE-3 and P-EAGLE: any) | as the target's (tp.parallelize_layer over a plan of the head's arch, head_plan): qkv, gate/up column-parallel, o, down row-parallel; its KV cache holds the rank's KV heads | two all-reduces a layer |
| ... over a DeepSeek target (MLA + a dense MLP, or an MoE MTP layer) | as the target's MLA layers: the rank's query heads, the latent projections whole, its cache the whole latent row (r + p); the MLP dense-split, or the experts TP-MoE / EP as the target's | two all-reduces (the MoE's one sums routed and shared) |
| DFlash's N decoder layers | each as a target layer (a ShardPlan of the head's own arch, prefix layers.i.); its context K/V cache holds the rank's KV heads | two all-reduces per layer (block pass) |
| its token embedding | the target's vocabulary-parallel embedding itself | one all-reduce |
| its lm_head (full vocabulary) | the target's vocabulary-parallel lm_head itself | one gather to the leader |
| a reduced vocabulary's V_draft rows (EAGLE-3's trained rows, the other heads' frozen rows of the target's lm_head) | replicated: every rank computes the draft logits from its complete hidden state | none |
| MTP's eh_proj, EAGLE-1/3's fc, norms, P-EAGLE's mask_hidden, DFlash's fc + hidden_norm, Medusa's blocks | replicated | none |

The head-only projections are replicated, not split: they are one 2H x H (or A*H x H)
matrix, a few percent of one target layer, and splitting them would add an all-reduce to
every draft step. The leader alone runs `first_hidden` (EAGLE-3's fc over the aux layers,
the post-norm input of EAGLE-1 / Medusa): its input, the target's hidden states, is complete
on the leader after the layer's all-reduce, and the state of each draft step is a selection
the leader makes (the carried rows, the tree's parents), so the leader sends the state with
the call. A head call is then ONE broadcast (step_sync: HEAD, tokens, layout with tree masks,
state bit-cast into the int64 buffer, logits rows, draft step k) plus the head's own
collectives (1 + 2 + 1 gather for an MTP/EAGLE step, no gather with a reduced vocabulary;
one gather for Medusa). A P-EAGLE round's mask pass is such a call with k = 2. DFlash has
two calls: a block pass (tokens, the blocks' layout and masks, logits rows: 1 + 2N
all-reduces and the gather) and a context write, whose state is the context
c = hidden_norm(fc(aux)) [T, H] the leader made of the verified rows' aux states, written by
every rank into its KV heads (the broadcast alone).

A reduced vocabulary's build reads its rows of the whole lm_head (so may a foreign
checkpoint's): build_tp_spec_engine gathers it once (full_lm_head, one all-reduce, V x H
for the moment of the build) and ShardedHead drops it again.
A draft LLM (LLMDrafter) and n-gram lookup run on the leader only: they never broadcast.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from inference_eval.engine.kv_cache import KVCache
from inference_eval.engine.model.transformer import TransformerLM
from inference_eval.engine.parallel import comm
from inference_eval.engine.parallel.group import TPGroup
from inference_eval.engine.parallel.shard import ShardPlan
from inference_eval.engine.parallel.step_sync import HEAD, StepChannel, StepMessage
from inference_eval.engine.parallel.tp import parallelize_layer
from inference_eval.engine.speculative.block_drafters import (BlockContextDrafter,
                                                              ParallelHeadDrafter)
from inference_eval.engine.speculative.drafters import HeadDrafter, MedusaDrafter


class ShardedHead:
    """A heads.DraftHead split for one rank in place (the table above). `target`: the
    rank's parallelized target (tp.parallelize), whose embedding and lm_head the head uses."""

    def __init__(self, head: nn.Module, target: TransformerLM, plan: ShardPlan,
                 tp: TPGroup) -> None:
        with torch.no_grad():
            if head.drafting == "block":  # DFlash: N layers with the target's attention shape
                own = ShardPlan(head.arch, tp.size, tp.rank)
                specs = own.specs()
                for i, layer in enumerate(head.decoder_layers):
                    parallelize_layer(layer, own, specs, f"layers.{i}.", tp)
                self.cache_arch = dataclasses.replace(own.local_arch(), n_routed_experts=0)
            elif head.attends:  # its layers split by a plan of its own arch (below)
                own = head_plan(head.arch, plan, tp)
                specs = own.specs()
                for i, layer in enumerate(head.decoder_layers):
                    parallelize_layer(layer, own, specs, f"layers.{i}.", tp)
                self.cache_arch = dataclasses.replace(own.local_arch(), n_routed_experts=0)
        emb, lm_head = target.embed_tokens, target.lm_head
        # The head's methods bound to the target's vocabulary-parallel modules, from outside:
        # the head's code stays single-device.
        object.__setattr__(head, "embed_tokens",
                           lambda tokens: emb(tokens).to(head.frozen.norm.weight.dtype))
        if head.draft_to_target() is None:
            object.__setattr__(head, "logits",
                               lambda features, cpu_blas=False: lm_head(features))
        # A reduced vocabulary keeps the head's own V_draft rows (replicated: every rank's
        # hidden state is complete after the layer's all-reduces, so no collective); the
        # target's full rows its build gathered (full_lm_head) are dropped here.
        head.frozen.weight = target.lm_head_weight.detach()
        head.requires_grad_(False)
        self.head, self.tp = head, tp

    def drafter(self, num_pages: int, page_size: int, device, dtype,
                channel: StepChannel | None = None, sync_free: bool = False):
        """The head's drafter on this rank: on the leader (channel given) every run() first
        sends the call; on a follower (channel None) runner.follow calls run()."""
        head = self.head
        if not head.attends:
            return TPMedusaDrafter(head, device, dtype, channel=channel)
        if head.drafting == "block":
            return TPBlockContextDrafter(head, num_pages, page_size, device, dtype,
                                         cache_arch=self.cache_arch, channel=channel)
        cls = TPParallelHeadDrafter if head.drafting == "parallel" else TPHeadDrafter
        return cls(head, num_pages, page_size, device, dtype, sync_free=sync_free,
                   cache_arch=self.cache_arch, channel=channel)


def head_plan(arch, plan: ShardPlan, tp: TPGroup) -> ShardPlan:
    """The split of a head's arch (heads.base.head_arch): the target's attention
    (GQA, or MLA: query heads split, the latent whole) with the head's own MLP kind, which
    need not be the kind of the target's layer 0 (a DeepSeek head's dense MLP over a target
    whose layer 0 is MoE, an MoE MTP layer over a dense first layer). Its routed experts
    split as the target's (TP-MoE or EP)."""
    return ShardPlan(arch, tp.size, tp.rank, plan.expert_parallel and arch.n_routed_experts > 0)


def full_lm_head(target: TransformerLM, plan: ShardPlan, tp: TPGroup) -> torch.Tensor:
    """The whole lm_head [V, H] on every rank, from the vocabulary-parallel rows (one
    all-reduce): what a reduced-vocabulary head's build reads its V_draft rows from. Every
    rank of the replica calls it; ShardedHead drops it again."""
    local = target.lm_head_weight
    rows = plan.vocab_per_rank
    full = local.new_zeros(rows * tp.size, local.shape[1])
    full[plan.vocab_start:plan.vocab_start + rows] = local
    return comm.all_reduce(full, tp)[:plan.arch.vocab_size]


class _SendsRuns:
    """run() of a drafter whose model is split: the leader broadcasts the call first."""

    channel: StepChannel | None = None

    def __init__(self, *args, channel: StepChannel | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.channel = channel

    def run(self, tokens, state, plan, rows=None, k=1):
        if self.channel is not None:
            self.channel.send(StepMessage(tokens, None if plan is None else plan.layout, rows,
                                          True, (), model=HEAD, state=state, k=k))
        return super().run(tokens, state, plan, rows, k)


class TPHeadDrafter(_SendsRuns, HeadDrafter):
    """HeadDrafter over a ShardedHead's MTP/EAGLE head (its cache: the rank's KV heads)."""


class TPMedusaDrafter(_SendsRuns, MedusaDrafter):
    """MedusaDrafter over a ShardedHead's Medusa heads (replicated blocks, shared lm_head)."""


class TPParallelHeadDrafter(_SendsRuns, ParallelHeadDrafter):
    """ParallelHeadDrafter over a ShardedHead's P-EAGLE head. Its mask pass is sent as a
    run(k=2), which is the same pass on a follower: under TP nothing is compiled or
    graphed (engine.compile and CUDA graphs are off), so run() is head.step(k=2)."""

    def _mask_pass(self, rows, plan):
        tokens = torch.zeros(rows, dtype=torch.long, device=self.device)  # read as the mask
        hidden = torch.zeros(rows, self.head.arch.hidden_size, dtype=self.cache.k.dtype,
                             device=self.device)
        return self.run(tokens, hidden, plan, k=2)[1]


class TPBlockContextDrafter(_SendsRuns, BlockContextDrafter):
    """BlockContextDrafter over a ShardedHead's DFlash head: its layers split, its context
    cache the rank's KV heads. Two calls, each one broadcast: a block pass (run, as sent by
    _SendsRuns) and a context write, whose state is the context c [T, H] the leader made of
    the target's aux rows (fc and hidden_norm replicated: no collective); every rank then
    writes its KV heads' keys and values of c."""

    def _cache_context(self, c, layout):
        if self.channel is not None:
            self.channel.send(StepMessage(c.new_zeros(0, dtype=torch.long), layout, None, True,
                                          (), model=HEAD, state=c))
        super()._cache_context(c, layout)


class LeaderKVCache(KVCache):
    """The leader's target cache: slot moves (a tree round compacting its accepted path) are
    also queued for the followers' shards; they ride on the next call's broadcast."""

    channel: StepChannel

    @classmethod
    def of(cls, cache: KVCache, channel: StepChannel) -> "LeaderKVCache":
        out = cls.__new__(cls)
        out.__dict__.update(cache.__dict__)
        out.channel = channel
        return out

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        super().copy_slots(src, dst)
        if src.numel():
            self.channel.moves.append((src, dst))
