"""Prompts to a trained head, three ways, on the same prompts, target, steps and threads:

  (a) distill -> precompute (a second prefill over prompt + answer) -> train from shards
  (b) distill writing shards in one pass (shards_dir, states captured while generating) -> train
  (c) online training with regeneration (data.online=true source.regenerate=true): nothing
      written but the head

    python scripts/bench_online.py                       # SmolLM2, 300 mix prompts (docs/online.md)
    python scripts/bench_online.py --prompts 8 --max-new-tokens 16 --steps 4   # a smoke run

Each stage runs as its own CLI process (what a user runs), timed wall clock; one JSON line at
the end: {"bench": "online", "a_s": ..., "b_s": ..., "c_s": ..., "speedup_b": a/b,
"speedup_c": a/c, "hidden_bytes_a": ..., "hidden_bytes_b": ..., "hidden_bytes_c": 0, ...}.
The hidden-state bytes are the shard files each way writes (c writes none: checked by
listing its output directory).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(module: str, *args: str, env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{module} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def shard_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*.safetensors")) if d.exists() else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--data", default="mix", help="a data preset of prompts (mix, sharegpt)")
    ap.add_argument("--prompts", type=int, default=300)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--head", default="mtp")
    ap.add_argument("--gen-batch", type=int, default=64,
                    help="engine.max_batch_size, all ways (the engine's default, and the batch "
                         "run_default.sh distills with)")
    ap.add_argument("--kv-cache-gb", type=float, default=2.0,
                    help="engine.kv_cache_gb, all ways (what 64 answers of 256 tokens need)")
    ap.add_argument("--threads", type=int, default=0, help="OMP threads (0: the machine's)")
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args()
    env = {**os.environ, "WANDB_MODE": "disabled"}
    if a.threads:
        env["OMP_NUM_THREADS"] = str(a.threads)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench_online_"))
    data = [f"data={a.data}", f"data.limit={a.prompts}"]
    target = [f"target={a.target}"]
    train = [*target, f"head={a.head}", f"trainer.max_steps={a.steps}",
             f"data.batch_tokens={a.batch_tokens}", "validation.enabled=false",
             "trainer.wandb=disabled", "trainer.progress=false", f"trainer.save_every={a.steps}",
             "optim.warmup_steps=10"]
    gen = [f"engine.max_batch_size={a.gen_batch}", f"engine.kv_cache_gb={a.kv_cache_gb}"]
    train += gen
    regen = ["data.regenerate=true", f"data.regen_max_new_tokens={a.max_new_tokens}", *gen]

    # (a) two passes: precompute data.regenerate did this before one-pass capture; here the
    # distill stage answers, then precompute reads the answers as chats and prefills them.
    da = work / "a"
    secs_a = run("precompute.distill", *target, *data, "turns=all", "progress=false",
                 f"sampling.max_new_tokens={a.max_new_tokens}", *gen,
                 f"output_dir={da / 'distill'}", env=env)
    secs_a += run("precompute", *target, "data=jsonl",
                  f"data.path={da / 'distill' / 'conversations.jsonl'}", "progress=false",
                  f"output_dir={da / 'shards'}", env=env)
    secs_a += run("train", *train, f"data.shards={da / 'shards'}", f"output_dir={da / 'head'}",
                  env=env)

    # (b) one pass: answers and shards together, then train from the shards.
    db = work / "b"
    secs_b = run("precompute", *target, *data, *regen, "progress=false",
                 f"output_dir={db / 'shards'}", env=env)
    secs_b += run("train", *train, f"data.shards={db / 'shards'}", f"output_dir={db / 'head'}",
                  env=env)

    # (c) online: the target answers inside the training job; no shard is written.
    dc = work / "c"
    src = [f"source={a.data}", f"source.limit={a.prompts}", "source.regenerate=true",
           f"source.regen_max_new_tokens={a.max_new_tokens}"]
    secs_c = run("train", *train, "data.online=true", *src, f"output_dir={dc / 'head'}",
                 env=env)
    bytes_c = sum(p.stat().st_size for p in dc.rglob("shard_*.safetensors"))
    result = {"bench": "online", "target": a.target, "prompts": a.prompts,
              "gen_batch": a.gen_batch,
              "max_new_tokens": a.max_new_tokens, "steps": a.steps, "threads": a.threads or None,
              "a_s": round(secs_a, 2), "b_s": round(secs_b, 2), "c_s": round(secs_c, 2),
              "speedup_b": round(secs_a / secs_b, 3), "speedup_c": round(secs_a / secs_c, 3),
              "hidden_bytes_a": shard_bytes(da / "shards"),
              "hidden_bytes_b": shard_bytes(db / "shards"), "hidden_bytes_c": bytes_c,
              "workdir": str(work)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
