"""The recipe study: which training recipe makes heads that accept, on the embedded target.

Every cell trains an MTP head on shards from the same data pipeline with the same compute
budget (optimizer steps x tokens per step, so the same number of token passes through the
head whatever the recipe), then scores it with real greedy speculative decoding in the engine
(chain K, batch 1) on held-out prompts of many categories (`prompts=heldout_mix`: chat, code,
writing, reasoning, math, ...; never trained on). Cells differ in one recipe choice each
against the cell named in `base`.

    .venv/bin/python scripts/recipe_study.py --shards distilled=runs/long/shards \
        original=runs/study/shards_orig --out runs/study [--steps 160] [--batch 2048] \
        [--per-category 2] [--new 48] [--cells vocab8k,init_target,...] [--tag a]

Two processes with OMP_NUM_THREADS=1 and disjoint --cells share a 2-core machine well.

Cells are resumable: a cell whose eval report exists is read back, not rerun. Prints a
table, then one JSON line {"bench": "recipe_study", "cells": [{name, data, overrides, tau,
alpha, exp_tau, train_s, ...}]}.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (name, data, train overrides, step scale). Each cell gets --steps x scale optimizer steps of
# --batch tokens, scaled so every cell costs about the same compute: a full-vocabulary lm_head
# makes a step ~3.5x dearer than an 8k one on SmolLM2 (49152 vs 8192 rows, forward + backward
# + the target's distribution), and a K-step rollout K times dearer than K = 1.
V8K = "head.draft_vocab_size=8192"
TGT = "trainer.init_from_target=true"
STAGED = "trainer.stages=[{num_steps:1,fraction:0.3},{num_steps:4,fraction:0.7}]"
CELLS = [
    ("full_vocab", "distilled", [], 1 / 3.5),
    ("original_data", "original", [V8K], 1.0),
    ("vocab8k", "distilled", [V8K], 1.0),
    ("init_target", "distilled", [V8K, TGT], 1.0),
    ("lr3e-3", "distilled", [V8K, TGT, "optim.lr=3e-3"], 1.0),
    ("k4", "distilled", [V8K, TGT, "head.num_steps=4"], 1 / 4),
    ("k4_staged", "distilled", [V8K, TGT, STAGED], 1 / 3.1),
    ("vocab4k", "distilled", ["head.draft_vocab_size=4096", TGT], 1.0),
    # EAGLE's feature regression beside the CE: the head's output state, which the next
    # chain step reads, is pulled toward the target's own next hidden state.
    ("feature_loss", "distilled", [V8K, "head.feature_loss_weight=1.0"], 1.0),
]


def run(cmd: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} failed (rc {proc.returncode}); see {log}")
    return time.perf_counter() - t0


def cell(args, name: str, shards: str, overrides: list[str], scale: float) -> dict:
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    head, report = out / "head", out / "eval" / "report.json"
    py = sys.executable
    train_s, steps = None, max(1, round(args.steps * scale))
    if not (head / "model.safetensors").is_file():
        train_s = run([py, "-m", "train", "target=smollm2", "head=mtp", f"data.shards={shards}",
                       f"output_dir={head}", f"trainer.max_steps={steps}",
                       f"data.batch_tokens={args.batch}", "optim.warmup_steps=10",
                       f"optim.lr={args.lr}", "trainer.log_every=10",
                       f"trainer.save_every={steps}", f"trainer.eval_every={steps}",
                       "trainer.wandb=disabled", "trainer.progress=false",
                       "validation.num_conversations=4", "validation.max_length=512",
                       "validation.tau_prompts=0", *overrides], out / "train.log")
    if not report.is_file():
        run([py, "-m", "inference_eval", "target=smollm2", "prompts=heldout_mix",
             f"prompts.per_category={args.per_category}", f"sampling.max_new_tokens={args.new}",
             "eval.batch_size=1", "eval.progress=false", f"output_dir={out / 'eval'}",
             f"drafts=[{{kind:head,checkpoint:{head},name:chain{args.k},num_draft:{args.k}}}]"],
            out / "eval.log")
    rep = json.loads(report.read_text())
    spec = rep["runs"][-1]
    metrics = json.loads((head / "config.json").read_text()).get("train", {}).get("metrics", {})
    return {"name": name, "data": Path(shards).name, "overrides": overrides, "steps": steps,
            "tau": spec["mean_accept_len"], "alpha": spec["per_position_accept_rate"],
            "speedup": spec.get("speedup"), "train_exp_tau": metrics.get("exp_tau_greedy"),
            "train_top1": metrics.get("top1_acc"), "train_s": train_s,
            "by_category": {c: v.get("mean_accept_len") for c, v in spec.get("by_category", {}).items()},
            "mismatched": (spec.get("lossless_check") or {}).get("mismatched")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", nargs="+", required=True, help="name=DIR for each data source")
    ap.add_argument("--out", default="runs/study")
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--cells", default=",".join(c[0] for c in CELLS))
    ap.add_argument("--tag", default="all", help="names this run's study_<tag>.json")
    args = ap.parse_args()
    shards = dict(s.split("=", 1) for s in args.shards)
    rows = []
    for name, data, overrides, scale in CELLS:
        if name not in args.cells.split(",") or data not in shards:
            continue
        rows.append(cell(args, name, shards[data], overrides, scale))
        r = rows[-1]
        print(f"{r['name']:14s} data={r['data']:14s} τ={r['tau']:.3f} "
              f"α={[round(a, 2) for a in r['alpha'] if a is not None]} "
              f"train exp τ={r['train_exp_tau']}", flush=True)
        (Path(args.out) / f"study_{args.tag}.json").write_text(json.dumps(rows, indent=1))
    print(json.dumps({"bench": "recipe_study", "steps": args.steps, "batch_tokens": args.batch,
                      "k": args.k, "cells": rows}))


if __name__ == "__main__":
    main()
