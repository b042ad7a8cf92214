"""Tensor-parallel decode on the CPU: a TP=2 (gloo) decode step against TP=1 on the same cores.

    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 \
        scripts/bench_tp.py [--target llama_160m|tiny|smollm2] [--batches 1 8] [--steps 16]

(smollm2 has 9 heads and 3 KV heads: run it with --nproc_per_node 3.)

- ours: the target split over the launched ranks (inference_eval/engine/parallel/), each rank
  on --threads torch threads; rank 0 schedules and samples, every step broadcasts its packed
  metadata. Timed: --steps decode steps of engine.step() after a prefill and 3 warm steps.
- base: the same engine in one fresh process (started by rank 0 after the TP run, the
  other ranks gone) with world x --threads threads, so both use the same cores; same target,
  dtype (fp32), batch, prompt length (--prompt-len random tokens) and steps.
- comm_share: the leader's seconds inside collectives over its step time (it includes
  waiting for the slower rank: imbalance shows up here, not as compute).
- collectives_per_step: counted on the leader over the timed decode steps.
Ends with one JSON line: {"bench": "tp", "tp", "target", "rows": [{"batch",
"ours_ms_step", "base_ms_step", "ratio" (base / ours: > 1 means TP is faster), "comm_share",
"collectives_per_step"}], ...}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import inference_eval  # noqa: F401  (first: its OpenBLAS setting must precede torch/numpy)
import torch

from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.parallel import comm
from inference_eval.engine.parallel.group import close_tensor_parallel, init_tensor_parallel
from inference_eval.engine.parallel.runner import load_tp_target, serve
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.target import TargetConfig, load_target

# Random Llama-style targets that 2, 4 and 8 ranks can split (SmolLM2's 9 heads need 3 or 9).
RANDOM = {
    "llama_160m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                       num_layers=8, num_heads=16, num_kv_heads=8, head_dim=64),
    "tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4,
                 num_heads=8, num_kv_heads=4, head_dim=32),
}


def target_config(name: str) -> TargetConfig:
    if name in RANDOM:
        return TargetConfig(name=name, source="random", path=None, arch=RANDOM[name])
    return TargetConfig()  # the embedded SmolLM2 (GGUF)


def time_decode(engine: LLMEngine, batch: int, prompt_len: int, steps: int) -> dict:
    """ms per decode step of `batch` requests, and the leader's collectives over them."""
    g = torch.Generator().manual_seed(0)
    vocab = engine.model.arch.vocab_size
    params = SamplingParams(max_new_tokens=steps + 5, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(3, vocab, (prompt_len,), generator=g).tolist(), params)
    for _ in range(4):  # the prefill, then warm decode steps
        engine.step()
    comm.reset()
    comm.timed = True
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    secs = time.perf_counter() - t0
    comm.timed = False
    out = {"ms_step": 1e3 * secs / steps, "comm_share": sum(comm.SECONDS.values()) / secs,
           "collectives_per_step": {k: v / steps for k, v in comm.COUNTS.items()}}
    while engine.scheduler.has_work:
        engine.step()
    return out


def baseline(args) -> dict[int, dict]:
    """TP=1 in this (fresh) process on args.threads threads: batch -> time_decode's dict."""
    torch.set_num_threads(args.threads)
    full = load_target(target_config(args.target), with_tokenizer=False).model
    out = {}
    for i, b in enumerate(args.batches):
        cfg = EngineConfig(page_size=16, num_pages=64 * max(args.batches), threads=args.threads,
                           max_batch_size=b)
        if i == 0:
            time_decode(LLMEngine(full, None, cfg), b, args.prompt_len, 2)  # as ours: warm
        out[b] = time_decode(LLMEngine(full, None, cfg), b, args.prompt_len, args.steps)
    return out


def run_baseline(args, threads: int) -> dict[int, dict]:
    """The baseline in a fresh process (no kernel, thread pool or allocator state of the
    TP run), with `threads` threads: the cores the TP ranks used."""
    argv = [sys.executable, __file__, "--baseline", "--target", args.target, "--threads",
            str(threads), "--steps", str(args.steps), "--prompt-len", str(args.prompt_len),
            "--batches", *map(str, args.batches)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return {int(b): r for b, r in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=(*RANDOM, "smollm2"), default="llama_160m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--baseline", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.baseline:
        print(json.dumps(baseline(args)))
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads)
    tp = init_tensor_parallel(world, "cpu", timeout_s=600)
    cfg = EngineConfig(page_size=16, num_pages=64 * max(args.batches), threads=args.threads,
                       max_batch_size=max(args.batches))
    loaded, plan = load_tp_target(target_config(args.target), tp, with_tokenizer=False)
    ours = {}
    with serve(loaded, plan, cfg, tp) as engine:
        if engine is not None:
            time_decode(engine, args.batches[0], args.prompt_len, 2)  # kernels built, races run
            for b in args.batches:
                ours[b] = time_decode(engine, b, args.prompt_len, args.steps)
    del loaded, engine
    close_tensor_parallel()
    if tp.rank != 0:
        return
    base_threads = world * args.threads
    base = run_baseline(args, base_threads)
    rows = []
    for b in args.batches:
        o, t1 = ours[b], base[b]
        rows.append({"batch": b, "ours_ms_step": round(o["ms_step"], 2),
                     "base_ms_step": round(t1["ms_step"], 2),
                     "ratio": round(t1["ms_step"] / o["ms_step"], 3),
                     "comm_share": round(o["comm_share"], 3),
                     "collectives_per_step": o["collectives_per_step"]})
        print(f"batch {b}: TP={world} {o['ms_step']:.1f} ms/step ({100 * o['comm_share']:.0f}% "
              f"in collectives) vs TP=1 {t1['ms_step']:.1f} ms/step")
    print(json.dumps({"bench": "tp", "tp": world, "target": args.target,
                      "threads_per_rank": args.threads, "base_threads": base_threads,
                      "steps": args.steps, "prompt_len": args.prompt_len, "rows": rows}))


if __name__ == "__main__":
    main()
