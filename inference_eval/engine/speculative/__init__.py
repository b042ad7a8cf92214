"""Speculative decoding: pure batched functions, the drafters, and the engines that run them.

Pure tensor functions (no engine state, no I/O; testable against a per-sequence loop):
- `chain`: verify K draft tokens per request (`verify_greedy`, `verify_sampled`), with
  per-request draft lengths.
- `tree`: EAGLE-2 dynamic draft trees (`tree_init` / `tree_expand` / `tree_prune`, or
  `build_tree`), their attention mask and rotary positions, verification
  (`verify_tree_greedy`, `verify_tree_sampled`) and what a round judged (`tree_path_proposed`).

Stateful objects (import them from their modules):
- `drafters`: the `Drafter` interface (prefill / begin_round / step / accept / drop) and the
  drafters behind it: `HeadDrafter` (MTP/EAGLE heads), `MedusaDrafter`, `LLMDrafter`.
- `spec_engine.SpecEngine`: chain drafting; `tree_engine.TreeSpecEngine`: EAGLE-2 trees.
  Both are `LLMEngine`s (same scheduler, pages, backend and generate API) and call only the
  drafter's interface; `inference_eval/evaluation/engines.py` builds them from configs.

All probabilities are the ones `sampling.processed_probs` returns, for target and draft alike,
so greedy requests (one-hot distributions) go through the sampled verifiers unchanged.
"""
from inference_eval.engine.speculative.chain import accept_mask, residual_probs, verify_greedy, verify_sampled
from inference_eval.engine.speculative.tree import (
    CHILD_MODES,
    DraftTree,
    build_tree,
    tree_attention_mask,
    tree_children,
    tree_emitted_tokens,
    tree_expand,
    tree_init,
    tree_positions,
    tree_path_proposed,
    tree_prune,
    verify_tree_greedy,
    verify_tree_sampled,
)

__all__ = [
    "CHILD_MODES", "DraftTree", "accept_mask", "build_tree", "residual_probs",
    "tree_attention_mask", "tree_children", "tree_emitted_tokens", "tree_expand", "tree_init",
    "tree_path_proposed", "tree_positions", "tree_prune", "verify_greedy", "verify_sampled",
    "verify_tree_greedy", "verify_tree_sampled",
]
