"""torch's intra-op thread count, set for a block and restored after it.

CPU fp32 steps keep torch at one thread where OpenBLAS runs some of their products
(linear.openblas_threads, used by llm_engine.step_threads and precompute/dump.py), compiled
kernels run at the count they were compiled for
(model/compiled.py), and long causal attention calls take the backend's count
(attention/torch_backend.py): all four switch through this one helper.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with torch.set_num_threads(n); None, or the current count, changes nothing."""
    prev = torch.get_num_threads()
    if n is None or n == prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)
