"""Shared fixtures: tiny random HF checkpoints of each family, and the embedded SmolLM2."""
from __future__ import annotations

import inference_eval  # noqa: F401  (first: its OpenBLAS setting must precede torch/numpy)
import pytest
import torch

torch.set_num_threads(2)

from tiny_hf_models import FAMILIES, make_tiny_hf  # noqa: E402,F401


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory):
    """family -> (hf_dir, hf_model), built lazily once per session."""
    cache = {}

    def get(family: str):
        if family not in cache:
            d = tmp_path_factory.mktemp(f"tiny_{family}")
            cache[family] = (d, make_tiny_hf(family, d))
        return cache[family]

    return get


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default target through our loader: (LoadedTarget, HF reference model)."""
    from transformers import AutoModelForCausalLM

    from inference_eval.engine.target import TargetConfig, load_target

    loaded = load_target(TargetConfig())
    hf = AutoModelForCausalLM.from_pretrained(loaded.hf_dir, dtype=torch.float32).eval()
    return loaded, hf


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: torch's second OpenMP thread only adds wake-up latency (a busy 2-core
    machine made single index_add_ calls take 40 ms). Modules opt in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
