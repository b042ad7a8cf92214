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


def test_steps_hold_torch_at_one_thread_only_beside_openblas(monkeypatch):
    from inference_eval.engine.model import cpu_linear, linear

    monkeypatch.setattr(cpu_linear, "serves_all_rows", lambda: True)
    assert linear.openblas_threads(True) is None  # the kernel serves every product
    monkeypatch.setattr(cpu_linear, "serves_all_rows", lambda: False)
    assert linear.openblas_threads(True) == 1  # OpenBLAS's spinning threads beside torch's
    assert linear.openblas_threads(False) is None  # no CPU fp32 path at all
