"""Shared pieces of the engine tests: a tiny random-weight target and random prompts."""
from __future__ import annotations

import torch

from inference_eval.engine.target import TargetConfig, load_target


def load_tiny(tiny_hf, family: str = "llama3"):
    """The tiny random-weight HF checkpoint of `family` through our loader (no tokenizer)."""
    hf_dir, _ = tiny_hf(family)
    return load_target(TargetConfig(name=family, source="hf", path=str(hf_dir)), with_tokenizer=False)


def random_prompts(k: int, seed: int, max_len: int, bos: int | None = 1) -> list[list[int]]:
    """k prompts of 3..max_len-1 random ids in [3, 320), each after `bos` (None: no BOS)."""
    g = torch.Generator().manual_seed(seed)
    head = [] if bos is None else [bos]
    return [head + torch.randint(3, 320, (int(torch.randint(3, max_len, (1,), generator=g)),),
                                 generator=g).tolist() for _ in range(k)]
