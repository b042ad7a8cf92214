"""The engine (`engine/`: target model, KV pages, scheduler, attention backends, speculative
schemes) and what measures heads with it (`evaluation/`: prompts, runs, metrics, reports)."""

import os

# OpenBLAS's worker threads spin for ~2^28 cycles (~0.1 s) after every call before they sleep.
# The engine's own CPU kernels and torch's run on an OpenMP pool, so after any OpenBLAS GEMM
# (a prefill, precompute) those spinning workers take the cores from them: 30 small-row
# products measured 4.1 ms alone and 11-40 ms right after OpenBLAS calls, and 4.1-6.1 ms with
# a spin of 2^4 cycles, which leaves OpenBLAS's own speed unchanged. It is read when OpenBLAS
# loads (with numpy, which `import torch` imports): every entry point imports this package
# before torch. A user's own setting wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
# The other way round: libgomp's idle workers (torch's pool and the engine's kernels) spin
# 300k rounds after each parallel region, long enough to take a core from the OpenBLAS GEMM
# that follows them in a prefill or precompute step. Measured on the 2-core Xeon (precompute's
# products inside the dump; bench_spec's batch-1 verification of 2 and 5 tokens): 300k rounds
# 238 GFLOP/s, 28.8 / 32.4 ms; 100k 265, 29.7 / 33.5; 30k 276-281, 28.8 / 32.3; 10k 286, but
# 31.4 / 35.2 (workers asleep between the verification's regions, woken each time).
# Read when libgomp loads (with torch).
os.environ.setdefault("GOMP_SPINCOUNT", "30000")
