"""fp32 matrix products on CPU that read each weight once per 128 rows (cpu_linear.cpp).

A batch-1 decode step pushes one row through every weight (SmolLM2: 540 MB a step), a
verification K + 1 rows, a small decode batch B rows: at these row counts a product is a
weight stream, and 5 rows should cost about what 1 does. The kernel keeps a tile of 3 rows x
8 outputs in registers (AVX-512; 1 x 8 with AVX2) so each weight vector loaded from memory
feeds every row of the tile, and splits the weight's rows between threads; it prefetches
the weight blocks ahead of the tiles (cpu_linear.cpp), since the stream, not the arithmetic,
sets the time. Figures: docs/benchmarks.md (scripts/bench_gemm.py, a whole SmolLM2 step's
products against OpenBLAS GEMV and GEMM, MKL and oneDNN).

Why not a library: a BLAS GEMV per row (the path this replaces) streams the weight once per
row, so 5 rows cost ~2x and 16 rows ~5x what 1 does; OpenBLAS's GEMM and MKL are tuned for
large products and lose to it at every count from 1 to 16 rows; oneDNN ties it from about 4
rows on but is 1.2-1.6x slower for one row, the batch-1 decode step, and wants its weights
re-laid-out per row count; inductor's CPU GEMM template (compiled.py) ties it at 1-4 rows and
takes a second pass over the weights from 5.

Past a few rows the same tiles are compute-bound, and chunks of 128 rows (x stays in L2
while every block of the weight reads it) kept the kernel ahead of OpenBLAS on an AVX-512
EPYC at every size measured, 48 to 4096 rows (scripts/bench_precompute.py's roofline). On
machines where OpenBLAS is faster there, max_rows() keeps it for the larger sizes.

The engine uses it for CPU fp32 inference products of up to max_rows() rows
(linear.matmul_wt), eager steps and compiled ones alike (in a compiled graph through the op
`specheads::small_linear`, registered by the kernel itself, which inductor calls as an
external kernel while it still fuses the step's elementwise work). Built once per machine
(engine/native.py); where it cannot be built those products keep their earlier paths.
"""
from __future__ import annotations

import functools
import json
import os
import time
from pathlib import Path

import numpy as np  # the BLAS that linear.py runs the larger products on
import torch

from inference_eval.engine import native

SMALL_ROWS = 16
# width: floats per vector of the built kernel (0: not built); max_rows: max_rows() once
# enabled, kept as a plain value because applies() runs per product and inside compiled graphs.
_state = {"width": 0, "threads": 1, "max_rows": SMALL_ROWS}
# Row counts at which max_rows() races the kernel against OpenBLAS (its own threads). 128:
# the 2-core Xeon's crossover lies between it and 192 (kernel 248-254 GFLOP/s at 64-128 rows
# against OpenBLAS's 165-212, 245 against 257 at 192, 238 against 275 at 512), so raced at 48
# and 512 only, its batch-64 decode products went to OpenBLAS.
RACE_ROWS = (48, 128, 512)
ALL_ROWS = 1 << 62  # max_rows() when the kernel won the race at every size


@functools.cache
def kernel():
    """The compiled module (its `small_linear`), or None where it cannot be built."""
    mod = native.build(Path(__file__).with_suffix(".cpp"),
                       "small-row products use OpenBLAS / torch instead")
    if mod is not None:
        _state["width"] = mod.vector_width()
        torch.library.register_fake("specheads::small_linear")(
            lambda x, weight, bias, threads: x.new_empty((x.shape[0], weight.shape[0])))
    return mod


def enable(threads: int) -> bool:
    """Build (once) and use the kernel with `threads` threads; whether it is available."""
    _state["threads"] = max(1, threads)
    _state["max_rows"] = max_rows()
    return kernel() is not None


@functools.cache
def max_rows() -> int:
    """Up to how many rows products run in the kernel: always SMALL_ROWS (where one pass
    over the weight is the point); beyond that, as far as it beat OpenBLAS when raced on
    three SmolLM2 layer shapes at RACE_ROWS rows (best of 3). On the 2-core
    EPYC (Zen 5) the kernel, in chunks of 128 rows, ran them at 275-330 GFLOP/s from 48 to
    2048 rows against OpenBLAS's 157-209 (a whole step's products: 250-290 vs 100-195), so
    it serves every size there; a machine whose BLAS wins keeps it for the larger products
    (the 2-core Xeon: up to 128 rows in the kernel, OpenBLAS beyond).

    The verdict is raced once per machine, kernel build and thread count, and kept beside the
    built kernel (`verdict_path`): the two paths sum in different orders, so a close race that
    went the other way in a second process would change its floats, and a resumed precompute
    must write the bytes the first process would have."""
    if kernel() is None:
        return SMALL_ROWS
    path = verdict_path()
    kept = read_verdict(path)
    if kept is not None:
        return kept
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(o, i, generator=gen) for o, i in ((3072, 576), (576, 1536), (960, 576))]
    cases = {m: [(torch.randn(m, w.shape[1], generator=gen), w) for w in weights]
             for m in RACE_ROWS}
    secs = time_paths(cases, reps=5)
    rows = pick_max_rows(secs["kernel"], secs["openblas"])
    write_verdict(path, rows, secs)
    return rows


def verdict_path() -> Path | None:
    """Where the race's verdict for this build and thread count is kept (None: no kernel)."""
    kern = kernel()
    if kern is None or not getattr(kern, "__file__", None):
        return None
    so = Path(kern.__file__)
    st = so.stat()
    # v2: raced with each path warmed first (time_paths); verdicts of the older race are
    # raced again.
    return so.parent / f"max_rows.v2.t{_state['threads']}.{st.st_mtime_ns}.{st.st_size}.json"


def read_verdict(path: Path | None) -> int | None:
    try:
        return int(json.loads(path.read_text())["max_rows"]) if path is not None else None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or unreadable: race again


def write_verdict(path: Path | None, rows: int, secs: dict) -> None:
    """Atomically (two processes may race at once; either verdict is a valid one); a
    read-only build directory just means racing per process, as before."""
    if path is None:
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"max_rows": rows, "seconds": secs}))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def time_paths(cases: dict, reps: int) -> dict[str, dict]:
    """Best-of-`reps` seconds of each case's products (a list of (x [M, in], w [out, in])
    pairs) through the kernel (where built), at the enabled thread count, and through
    OpenBLAS (numpy): {"kernel": {case: s}, "openblas": {case: s}}. Every kernel run comes
    first: OpenBLAS's threads spin for a while after each call and would slow the kernel's
    measured beside them. Each path first runs every case once untimed: a path's first
    calls (its thread pool starting, outputs first touched, the clock ramping up after a
    build) once took the kernel 5.4 ms at 48 rows against its 1.0, and a verdict raced that
    way halved prefill's speed for as long as it was kept."""
    kern, threads = kernel(), _state["threads"]
    paths = {"openblas": lambda pairs: [np.matmul(x.numpy(), w.t().numpy()) for x, w in pairs]}
    if kern is not None:
        paths = {"kernel": lambda pairs: [kern.small_linear(x, w, None, threads)
                                          for x, w in pairs], **paths}
    out = {}
    for name, run in paths.items():
        for pairs in cases.values():
            run(pairs)
        out[name] = {key: _best_of(reps, lambda: run(pairs)) for key, pairs in cases.items()}
    return out


def pick_max_rows(ours: dict[int, float], blas: dict[int, float]) -> int:
    """The race's verdict from seconds by row count (RACE_ROWS): the kernel keeps each size
    up to the first it lost; winning the largest, it keeps every size (ALL_ROWS)."""
    rows = SMALL_ROWS
    for m in RACE_ROWS:
        if ours[m] > blas[m]:
            break
        rows = m if m < RACE_ROWS[-1] else ALL_ROWS
    return rows


def serves_all_rows() -> bool:
    """Whether CPU fp32 inference products of every size run in the kernel (no OpenBLAS)."""
    return kernel() is not None and max_rows() == ALL_ROWS


def _best_of(n: int, fn) -> float:
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x [M, in] @ weight[out, in].T runs in the kernel: built, CPU fp32 inference,
    M <= max_rows(), a contiguous weight whose dims fit the kernel's vectors."""
    w = _state["width"]
    return (w > 0 and x.dim() == 2 and x.shape[0] <= _state["max_rows"] and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.is_contiguous() and weight.shape[1] % w == 0 and weight.shape[0] % 8 == 0
            and not torch.is_grad_enabled())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] @ weight[out, in].T + bias [out] -> [M, out]; call only where applies()."""
    # Eagerly the pybind call skips the dispatcher (~121 calls a step); a compiled graph
    # needs the dispatcher op (cpu_linear.cpp) as its node.
    if torch.compiler.is_compiling():
        return torch.ops.specheads.small_linear(x.contiguous(), weight, bias, _state["threads"])
    return kernel().small_linear(x.contiguous(), weight, bias, _state["threads"])


def threads() -> int:
    """The thread count the product kernels run with (set by enable)."""
    return _state["threads"]
