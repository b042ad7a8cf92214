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
# ~300k rounds after each parallel region, long enough to take a core from the OpenBLAS GEMM
# that follows them in a prefill or precompute step: the dump's products ran at 238 GFLOP/s
# with the default and 286 with 10k rounds (the 2-core Xeon), decode steps (regions tens of
# microseconds apart) as fast as before (batch 1) or faster (batch 8: 180 -> 203 tok/s).
# Read when libgomp loads (with torch).
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
