"""Building the engine a run asks for: the autoregressive baseline, or a speculative engine
with a head checkpoint (ours or a foreign format: MTP/EAGLE heads as `HeadDrafter`, Medusa
heads as `MedusaDrafter`, block heads (DFlash, P-EAGLE: `head.drafting`) as the block drafters
of engine/speculative/block_drafters.py) or a small LLM as its drafter. This is where heads meet the engine;
the engine itself never imports heads."""
from __future__ import annotations

import dataclasses
import functools

from heads.checkpoint import load_head, read_head_config
from heads.formats import specheads
from heads.frozen import FrozenParts
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.parallel.spec import ShardedHead, full_lm_head
from inference_eval.engine.speculative.block_drafters import (BlockContextDrafter,
                                                              ParallelHeadDrafter)
from inference_eval.engine.speculative.drafters import HeadDrafter, LLMDrafter, MedusaDrafter
from inference_eval.engine.speculative.lookup_drafter import LookupDrafter
from inference_eval.engine.speculative.spec_engine import SpecEngine
from inference_eval.engine.speculative.tree_engine import TreeSpecEngine
from inference_eval.engine.target import LoadedTarget, load_target
from inference_eval.evaluation.lookup_corpus import load_lookup_table


def frozen_parts_of(loaded):
    """The target's frozen tensors for a head, taken from the already loaded engine model."""
    m = loaded.model
    return FrozenParts(m.arch, m.embed_tokens.weight, m.norm.weight, m.lm_head_weight,
                       loaded.identity)


def build_engine(loaded: LoadedTarget, engine_cfg: EngineConfig, draft_cfg,
                 sharded: ShardedHead | None = None, channel=None) -> LLMEngine:
    """The engine of one run; every engine has LLMEngine's generate() and meta contract.
    draft_cfg.kind: none -> LLMEngine; head -> a head checkpoint drafting a chain or tree;
    llm -> a separate small LLM (draft_cfg.llm, a TargetConfig) with the same tokenizer;
    lookup -> n-gram lookup only (draft_cfg.lookup puts it in front of a head or an LLM)."""
    if draft_cfg.kind == "none":
        return LLMEngine(loaded.model, loaded.tokenizer, engine_cfg)
    if sharded is None and channel is None:
        return build_spec_engine(loaded, engine_cfg, draft_cfg)
    return build_spec_engine(loaded, engine_cfg, draft_cfg, sharded=sharded, channel=channel)


def build_spec_engine(loaded: LoadedTarget, engine_cfg: EngineConfig, draft_cfg,
                      sharded: ShardedHead | None = None, channel=None) -> SpecEngine:
    """sharded, channel: under tensor parallelism (build_tp_spec_engine), the head already
    split with the target and the leader's step channel its drafter sends head calls on."""
    kind = draft_cfg.kind
    scheme = getattr(draft_cfg, "scheme", "chain")
    if scheme not in ("chain", "tree"):
        raise ValueError(f"draft.scheme={scheme!r}: use chain or tree")
    if scheme == "tree" and kind != "head":
        raise ValueError("draft.scheme=tree needs draft=head (an MTP/EAGLE head); use "
                         "scheme=chain for draft=llm")
    lookahead = None  # the engine's default: the K + 1 cache slots a round verifies
    if kind == "head":
        meta = read_head_config(draft_cfg.checkpoint)
        want, have = meta.get("target", {}).get("frozen_sha256"), loaded.identity.get("frozen_sha256")
        if want and have and want != have:
            raise ValueError(f"head {draft_cfg.checkpoint} was trained for target "
                             f"{meta['target'].get('name')!r} with other embedding/lm_head weights "
                             f"than {loaded.identity['name']!r}; train a head for this target")
        head = sharded.head if sharded else load_head(draft_cfg.checkpoint, frozen_parts_of(loaded))
        sync_free = getattr(draft_cfg, "sync_free", False)
        if not head.attends:  # Medusa: no token input, no KV cache, so no tree either
            _check_medusa(head, draft_cfg)
            make = lambda pages, ps, dev, dt: MedusaDrafter(head, dev, dt)  # noqa: E731
        elif head.drafting != "chain":  # a block drafter: one draft pass per round
            make, lookahead = _block_drafter(head, draft_cfg, scheme)
        else:
            make = lambda pages, ps, dev, dt: HeadDrafter(head, pages, ps, dev, dt,  # noqa: E731
                                                          sync_free=sync_free)
        if sharded is not None:  # split with the target: its drafter sends each call first
            make = lambda pages, ps, dev, dt: sharded.drafter(  # noqa: E731
                pages, ps, dev, dt, channel=channel, sync_free=sync_free)
    elif kind == "llm":
        draft = load_target(draft_cfg.llm, device=next(loaded.model.parameters()).device,
                            with_tokenizer=False).model
        if draft.arch.vocab_size != loaded.model.arch.vocab_size:
            raise ValueError(f"draft LLM vocab {draft.arch.vocab_size} != target vocab "
                             f"{loaded.model.arch.vocab_size}: a draft must share the tokenizer")
        make = lambda pages, ps, dev, dt: LLMDrafter(draft, pages, ps, dev, dt)  # noqa: E731
    elif kind == "lookup":
        make = lambda pages, ps, dev, dt: None  # noqa: E731
    else:
        raise ValueError(f"draft.kind={kind!r}: use none, head, llm or lookup")
    if getattr(draft_cfg, "lookup", False):
        make = _with_lookup(make, loaded, draft_cfg)
    if scheme == "tree":
        return TreeSpecEngine(loaded.model, loaded.tokenizer, engine_cfg, make, draft_cfg.depth,
                              draft_cfg.topk, draft_cfg.total_tokens, lookahead=lookahead)
    return SpecEngine(loaded.model, loaded.tokenizer, engine_cfg, make, draft_cfg.num_draft,
                      lookahead=lookahead, min_confidence=getattr(draft_cfg, "min_confidence", 0.0),
                      confidence_cut=getattr(draft_cfg, "confidence_cut", "draft"),
                      round_costs=getattr(draft_cfg, "round_costs", None))


def build_tp_spec_engine(loaded: LoadedTarget, plan, tp, draft_cfg):
    """Speculative decoding under tensor parallelism: (build, make_drafter) for
    parallel.runner.serve. A head checkpoint is loaded on every rank and split with the
    target (parallel/spec.py: its layers sharded, the target's vocabulary-parallel embedding
    and lm_head shared, a reduced vocabulary's own rows replicated); followers run its calls.
    A draft LLM and lookup live on the leader only (followers get no drafter)."""
    sharded = None
    if draft_cfg.kind == "head":
        meta = read_head_config(draft_cfg.checkpoint)
        parts = frozen_parts_of(loaded)  # the rank's rows of the embedding and lm_head
        if meta.get("head", {}).get("draft_vocab_size") or not specheads.detect(meta):
            # A reduced vocabulary's build reads its V_draft rows of the whole lm_head (a
            # foreign checkpoint may hold one): gathered once, dropped by ShardedHead.
            parts = dataclasses.replace(parts, lm_head=full_lm_head(loaded.model, plan, tp))
        head = load_head(draft_cfg.checkpoint, parts)
        if not head.attends:
            _check_medusa(head, draft_cfg)  # on every rank, before any is split
        elif head.drafting != "chain":
            _block_drafter(head, draft_cfg, getattr(draft_cfg, "scheme", "chain"))  # its checks
        sharded = ShardedHead(head, loaded.model, plan, tp)
    sync_free = getattr(draft_cfg, "sync_free", False)

    def build(model, channel, engine_cfg):
        return build_engine(dataclasses.replace(loaded, model=model), engine_cfg, draft_cfg,
                            sharded=sharded, channel=channel)

    def make_drafter(pages, ps, dev, dt):
        return None if sharded is None else sharded.drafter(pages, ps, dev, dt, sync_free=sync_free)
    return build, make_drafter


def _check_medusa(head, draft_cfg) -> None:
    """Medusa heads have no token input and no cache: no tree to grow, nothing to catch up."""
    if getattr(draft_cfg, "scheme", "chain") == "tree":
        raise ValueError(f"draft.scheme=tree needs draft=head with an MTP/EAGLE head; "
                         f"{draft_cfg.checkpoint} holds a {head.cfg.type!r} head (no "
                         "token input to grow a tree from): use scheme=chain")
    if getattr(draft_cfg, "sync_free", False):
        raise ValueError(f"draft.sync_free needs an MTP/EAGLE head; {draft_cfg.checkpoint} "
                         "holds a Medusa head (no cache to catch up)")


def _block_drafter(head, draft_cfg, scheme: str):
    """(drafter factory, cache lookahead) of a head that drafts a round in one pass: P-EAGLE
    (drafting "parallel") or DFlash ("block"), whose block needs B cache slots per round."""
    name = f"{draft_cfg.checkpoint} holds a {head.cfg.type!r} head drafting {head.drafting!r}"
    k = draft_cfg.depth if scheme == "tree" else draft_cfg.num_draft
    sync_free = getattr(draft_cfg, "sync_free", False)
    if head.drafting == "parallel":
        return (lambda pages, ps, dev, dt: ParallelHeadDrafter(  # noqa: E731
            head, pages, ps, dev, dt, sync_free=sync_free)), None
    if sync_free:
        raise ValueError(f"draft.sync_free: {name}, which has no sync-free catch-up")
    return ((lambda pages, ps, dev, dt: BlockContextDrafter(head, pages, ps, dev, dt)),  # noqa: E731
            max(k, head.block_size - 1) + 1)


@functools.lru_cache(maxsize=4)
def _corpus_table(corpus: str, tokenizer):
    """The corpus table, built once per corpus and tokenizer: an eval rebuilds its engines for
    every pass and run."""
    return load_lookup_table(corpus, tokenizer)


def _with_lookup(make, loaded: LoadedTarget, draft_cfg):
    """A drafter factory whose drafter sits behind n-gram lookup."""
    corpus = getattr(draft_cfg, "lookup_corpus", None)
    table = None if corpus is None else _corpus_table(str(corpus), loaded.tokenizer)
    vocab = loaded.model.arch.vocab_size

    def make_lookup(pages, ps, dev, dt):
        return LookupDrafter(make(pages, ps, dev, dt), table, vocab, dev,
                             model_draft=getattr(draft_cfg, "model_draft", None),
                             min_match=draft_cfg.lookup_min_match, max_match=draft_cfg.lookup_max_match)
    return make_lookup
