"""Replace assistant turns with the target's own answers (data.regenerate=true).

Heads trained on the target's own outputs accept more at serving time, because that is the
distribution they will draft against. Turn k of every conversation is regenerated in one
batched engine call (continuous batching), conditioned on the already regenerated turns < k.
"""
from __future__ import annotations

from dataclasses import replace

from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.sampling import SamplingParams
from precompute.data import Conversation, DataConfig, Turn


def regenerate(engine: LLMEngine, convs: list[Conversation], cfg: DataConfig,
               progress: bool = True) -> tuple[list[Conversation], dict[str, int]]:
    """Returns the conversations with regenerated assistant turns and counts
    {"regenerated_turns", "kept_original_turns"} (a turn whose prompt no longer fits the
    context keeps its original answer)."""
    params = SamplingParams(temperature=cfg.regen_temperature,
                            max_new_tokens=cfg.regen_max_new_tokens)
    turns = [list(c.turns) for c in convs]
    counts = {"regenerated_turns": 0, "kept_original_turns": 0}
    depth = max((sum(t.role == "assistant" for t in ts) for ts in turns), default=0)
    for k in range(depth):
        jobs = []  # (conversation index, turn index)
        for ci, ts in enumerate(turns):
            positions = [i for i, t in enumerate(ts) if t.role == "assistant"]
            if k < len(positions):
                jobs.append((ci, positions[k]))
        prompts = [[{"role": t.role, "content": t.content} for t in turns[ci][:ti]]
                   for ci, ti in jobs]
        results = engine.generate(prompts, params, chat=True, progress=progress)
        for (ci, ti), res in zip(jobs, results):
            if res.error is None and res.text and res.text.strip():
                turns[ci][ti] = Turn("assistant", res.text)
                counts["regenerated_turns"] += 1
            else:
                counts["kept_original_turns"] += 1
    return [replace(c, turns=ts) for c, ts in zip(convs, turns)], counts
