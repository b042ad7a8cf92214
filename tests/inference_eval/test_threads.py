"""inference_eval/engine/threads.py: the one thread-count switch every step uses."""
from __future__ import annotations

import pytest
import torch

from inference_eval.engine.threads import torch_threads


def test_torch_threads_sets_the_count_inside_and_restores_it_even_on_error():
    prev = torch.get_num_threads()
    with torch_threads(prev + 1):
        assert torch.get_num_threads() == prev + 1
    assert torch.get_num_threads() == prev
    with pytest.raises(RuntimeError):
        with torch_threads(prev + 1):
            raise RuntimeError("step failed")
    assert torch.get_num_threads() == prev
    with torch_threads(None):
        assert torch.get_num_threads() == prev
