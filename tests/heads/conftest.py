"""The tiny random target the head tests share (built from its config: no files)."""
from __future__ import annotations

import pytest

from heads.frozen import load_frozen
from inference_eval.engine.target import TargetConfig

TINY = TargetConfig(name="tiny-test", source="random", path=None, seed=3, arch=dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=16, tie_word_embeddings=True))


@pytest.fixture(scope="module")
def parts():
    """The frozen embeddings, final norm and lm_head of TINY."""
    return load_frozen(TINY)
