"""Small-row fp32 matrix products on CPU: which maintained path reads each weight once.

A batch-1 decode step is M = 1 row through every weight; a speculative verification is M =
K + 1 rows, a small decode batch M = B. At these M the product is a weight stream (SmolLM2:
540 MB per step), so M = 5 should cost little more than M = 1. This measures, on SmolLM2's
weight shapes (30 of each layer weight, so nothing stays in cache between steps, and the
tied lm_head), the paths `inference_eval.engine.model.linear` chose between:

    openblas   numpy's matmul (OpenBLAS), the weight as a C-contiguous [in, out] array
    gemv_rows  one OpenBLAS GEMV per row (a weight larger than the cache is re-streamed)
    mkl        torch's F.linear (MKL on this build)
    onednn     oneDNN through torch (`torch.ops.mkldnn._linear_pointwise`) on a weight
               reordered once into oneDNN's blocked layout
    kernel     the engine's own small-row kernel (model/cpu_linear.cpp), up to SMALL_ROWS
               rows, the weight as is ([out, in] row-major)
    quant      the same products from the weights' exact GGUF block code (model/cpu_quant.cpp;
               the weights here are GGUF-coded like the embedded target's: layers Q4_1, the
               lm_head Q8_0), bit for bit the kernel's result

(inductor's CPU GEMM template, which compiled steps used before the kernel, needs a compile
per row count; model/cpu_linear.py and model/compiled.py quote it measured beside the kernel.)

    .venv/bin/python scripts/bench_gemm.py [--rows 1 2 3 4 5 6 8 12 16] [--reps 10]

Every path is timed round-robin per M (medians of --reps). Prints one table per shape group
(ms per step-equivalent: all 30 layers' weights, or the lm_head once), the ratio of each M's
best path to the M = 1 best, and one JSON line {"bench": "gemm", "rows": ..., "best": {M:
path}, "ms": {...}}. Run it with nothing else on the machine.
"""
from __future__ import annotations

import inference_eval  # noqa: F401  (first: its OpenBLAS setting must precede torch/numpy)

import argparse
import json
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from inference_eval.engine.model import cpu_linear, cpu_quant
from inference_eval.engine.model.linear import gemv_rows

# SmolLM2-135M: hidden 576, 9 q heads + 2 x 3 kv heads of 64, MLP 1536, vocab 49152.
LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = (49152, 576)
NUM_LAYERS = 30


def coded(w: torch.Tensor, fmt: int) -> torch.Tensor:
    """The weights as the embedded GGUF target holds them (layers Q4_1, lm_head Q8_0), so the
    `quant` path (cpu_quant: the same floats from their block code) applies; every other path
    reads them as fp32."""
    return cpu_quant.gguf_round_trip(w, fmt)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def paths(weights: list[torch.Tensor], m: int) -> dict:
    """name -> callable(x) running x through every weight once."""
    wts = [w.t().contiguous().numpy() for w in weights]  # [in, out] C-contiguous
    out = {
        "openblas": lambda x: [np.matmul(x.numpy(), wt) for wt in wts],
        "gemv_rows": lambda x: [[np.matmul(r, wt) for r in x.numpy()] for wt in wts],
        "mkl": lambda x: [F.linear(x, w) for w in weights],
    }
    if m <= cpu_linear.SMALL_ROWS and cpu_linear.enable(torch.get_num_threads()):
        small, n = cpu_linear.kernel().small_linear, torch.get_num_threads()
        out["kernel"] = lambda x: [small(x, w, None, n) for w in weights]
    coded = [cpu_quant.pack(w) for w in weights]
    if m <= cpu_linear.SMALL_ROWS and all(coded) and cpu_quant.kernel() is not None:
        out["quant"] = lambda x: [cpu_quant.linear(x, p) for p in coded]
    if onednn_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in weights]
        out["onednn"] = lambda x: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                   for p in packed]
    return out


def measure(weights: list[torch.Tensor], rows: list[int], reps: int) -> dict[int, dict[str, float]]:
    res = {}
    for m in rows:
        x = torch.randn(m, weights[0].shape[1])
        fns = paths(weights, m)
        times = {n: [] for n in fns}
        for rep in range(reps + 1):
            for n, fn in fns.items():
                t = time.perf_counter()
                fn(x)
                if rep:
                    times[n].append(time.perf_counter() - t)
        res[m] = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    return res


def table(title: str, res: dict[int, dict[str, float]]) -> None:
    names = list(dict.fromkeys(n for r in res.values() for n in r))  # the kernel stops at 16
    base = min(res[min(res)].values())
    print(f"\n{title} (ms, median)\n{'M':>3} " + " ".join(f"{n:>10}" for n in names)
          + f" {'best':>10} {'best/M1':>8}")
    for m, r in res.items():
        best = min(r, key=r.get)
        print(f"{m:>3} " + " ".join(f"{r.get(n, float('nan')):>10.2f}" for n in names)
              + f" {best:>10} {r[best] / base:>8.2f}")


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6, 8, 12, 16])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    r_layers = None
    for shape in LAYER.values():  # 30 weights of each shape; their times add up to a step's
        r = measure([coded(torch.randn(*shape, generator=gen) * 0.02, 4) for _ in range(NUM_LAYERS)],
                    args.rows, args.reps)
        r_layers = r if r_layers is None else {
            m: {n: r_layers[m][n] + r[m][n] for n in r[m]} for m in r}
    r_head = measure([coded(torch.randn(*LM_HEAD, generator=gen) * 0.02, 8)], args.rows, args.reps)
    table(f"{NUM_LAYERS} layers x (qkv, o, gate_up, down)", r_layers)
    table("lm_head 49152 x 576", r_head)
    total = {m: {n: r_layers[m][n] + r_head[m][n] for n in r_layers[m]} for m in args.rows}
    table("a whole step's products", total)
    best = {m: min(r, key=r.get) for m, r in total.items()}
    # What the engine dispatches (model/linear.py), for comparison with the best path.
    layer_rows, head_rows = gemv_rows(torch.empty(LAYER["gate_up"])), gemv_rows(torch.empty(LM_HEAD))
    print(f"\nengine: the kernel up to {cpu_linear.SMALL_ROWS} rows where it is built (else one "
          f"GEMV per row up to {layer_rows} rows for layer weights, up to {head_rows} for the "
          "lm_head); one OpenBLAS GEMM beyond")
    print(json.dumps({"bench": "gemm", "threads": torch.get_num_threads(), "rows": args.rows,
                      "best": best, "ms": {m: {n: round(v, 2) for n, v in r.items()}
                                           for m, r in total.items()}}))


if __name__ == "__main__":
    main()
