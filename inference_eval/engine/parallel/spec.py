"""Speculative decoding under tensor parallelism: a draft head split with the target.

What each rank holds (T ranks; the head is built whole from its checkpoint on every rank,
then `ShardedHead` keeps the rank's part, as tp.parallelize does for the target):

| part | form | communication per head call |
|---|---|---|
| the head's decoder layer (MTP, EAGLE-1/3) | as the target's (tp.parallelize_layer): qkv, gate/up column-parallel, o, down row-parallel; its KV cache holds the rank's KV heads | two all-reduces |
| its token embedding | the target's vocabulary-parallel embedding itself | one all-reduce |
| its lm_head | the target's vocabulary-parallel lm_head itself | one gather to the leader |
| MTP's eh_proj, EAGLE-1/3's fc, norms, P-EAGLE's mask_hidden, Medusa's blocks | replicated | none |
| EAGLE-3's own lm_head rows (reduced vocabulary) | refused under TP (build_head initializes them from the full lm_head) | - |

The head-only projections are replicated, not split: they are one 2H x H (or A*H x H)
matrix, a few percent of one target layer, and splitting them would add an all-reduce to
every draft step. The leader alone runs `first_hidden` (EAGLE-3's fc over the aux layers,
the post-norm input of EAGLE-1 / Medusa): its input, the target's hidden states, is complete
on the leader after the layer's all-reduce, and the state of each draft step is a selection
the leader makes (the carried rows, the tree's parents), so the leader sends the state with
the call. A head call is then ONE broadcast (step_sync: HEAD, tokens, layout with tree masks,
state bit-cast into the int64 buffer, logits rows, draft step k) plus the head's own
collectives (1 + 2 + 1 gather for an MTP/EAGLE step; one gather for Medusa).

A draft LLM (LLMDrafter) and n-gram lookup run on the leader only: they never broadcast.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from inference_eval.engine.kv_cache import KVCache
from inference_eval.engine.model.transformer import TransformerLM
from inference_eval.engine.parallel.group import TPGroup
from inference_eval.engine.parallel.shard import ShardPlan
from inference_eval.engine.parallel.step_sync import HEAD, StepChannel, StepMessage
from inference_eval.engine.parallel.tp import parallelize_layer
from inference_eval.engine.speculative.drafters import HeadDrafter, MedusaDrafter


class ShardedHead:
    """A heads.DraftHead split for one rank in place (the table above). `target`: the
    rank's parallelized target (tp.parallelize), whose embedding and lm_head the head uses."""

    def __init__(self, head: nn.Module, target: TransformerLM, plan: ShardPlan,
                 tp: TPGroup) -> None:
        if getattr(head, "draft_to_target", lambda: None)() is not None:
            raise ValueError("a head with a reduced vocabulary (head.draft_vocab_size) under "
                             f"engine.tensor_parallel={tp.size} is not supported yet: use a "
                             "full-vocabulary head or tensor_parallel=1")
        if head.attends:
            with torch.no_grad():
                parallelize_layer(head.layer, plan, plan.specs(), "layers.0.", tp)
        emb, lm_head = target.embed_tokens, target.lm_head
        # The head's methods bound to the target's vocabulary-parallel modules, from outside:
        # the head's code stays single-device.
        object.__setattr__(head, "embed_tokens",
                           lambda tokens: emb(tokens).to(head.frozen.norm.weight.dtype))
        object.__setattr__(head, "logits", lambda features, cpu_blas=False: lm_head(features))
        head.requires_grad_(False)
        self.head, self.tp = head, tp
        self.cache_arch = dataclasses.replace(plan.local_arch(), num_layers=1,
                                              n_routed_experts=0)

    def drafter(self, num_pages: int, page_size: int, device, dtype,
                channel: StepChannel | None = None, sync_free: bool = False):
        """The head's drafter on this rank: on the leader (channel given) every run() first
        sends the call; on a follower (channel None) runner.follow calls run()."""
        if not self.head.attends:
            return TPMedusaDrafter(self.head, device, dtype, channel=channel)
        return TPHeadDrafter(self.head, num_pages, page_size, device, dtype, sync_free=sync_free,
                             cache_arch=self.cache_arch, channel=channel)


class _SendsRuns:
    """run() of a drafter whose model is split: the leader broadcasts the call first."""

    channel: StepChannel | None = None

    def run(self, tokens, state, plan, rows=None, k=1):
        if self.channel is not None:
            self.channel.send(StepMessage(tokens, None if plan is None else plan.layout, rows,
                                          True, (), model=HEAD, state=state, k=k))
        return super().run(tokens, state, plan, rows, k)


class TPHeadDrafter(_SendsRuns, HeadDrafter):
    """HeadDrafter over a ShardedHead's MTP/EAGLE head (its cache: the rank's KV heads)."""

    def __init__(self, *args, channel: StepChannel | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.channel = channel


class TPMedusaDrafter(_SendsRuns, MedusaDrafter):
    """MedusaDrafter over a ShardedHead's Medusa heads (replicated blocks, shared lm_head)."""

    def __init__(self, *args, channel: StepChannel | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        self.channel = channel


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
