"""Speculative decoding on SmolLM2: what a trained head is worth, measured with the engine.

For each (batch size, temperature) cell it runs the eval CLI's code path once
(`inference_eval.evaluation.evaluate.main`): the draft=none autoregressive baseline first, then chain
K=2, chain K=4 and an EAGLE-2 tree with the same head, on the same prompts, max new tokens,
batch size, sampling settings, dtype and threads. So every speedup is a ratio of two
measurements taken in the same process minutes apart, and every run's greedy output is
checked token for token against the baseline.

    .venv/bin/python scripts/bench_spec.py --head runs/long/head [--prompts 8] [--new 64]
        [--batch-sizes 1 8] [--temperatures 0 1] [--tree 4 4 12] [--out runs/bench_spec]

Each cell writes a full report (report.json/md, plots) under --out/bs{B}_t{T}/. Prints a
table, then one JSON line: {"bench": "spec", "cells": [{"batch_size", "temperature", "runs":
[{"name", "tau", "alpha", "speedup", "tok_s", "ar_tok_s", "time_split_s", "mismatched"}]}]}.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from inference_eval.evaluation import evaluate
from inference_eval.evaluation.config import EvalConfig
from inference_eval.hydra_app import compose


def cell(args: argparse.Namespace, bs: int, temp: float) -> dict:
    head = args.head
    depth, topk, total = args.tree
    drafts = (f"[{{kind:head,checkpoint:{head},name:chain2,num_draft:2}},"
              f"{{kind:head,checkpoint:{head},name:chain4,num_draft:4}},"
              f"{{kind:head,checkpoint:{head},name:tree,scheme:tree,depth:{depth},topk:{topk},"
              f"total_tokens:{total}}}]")
    out = Path(args.out) / f"bs{bs}_t{temp:g}"
    cfg = compose("eval", EvalConfig, [
        f"target={args.target}", f"prompts={args.prompt_set}", f"prompts.limit={args.prompts}",
        f"sampling.max_new_tokens={args.new}", f"sampling.temperature={temp}",
        f"eval.batch_size={bs}", "eval.progress=false", f"drafts={drafts}", f"output_dir={out}",
        f"engine.seed={args.seed}"])
    report = evaluate.main(cfg)
    runs = []
    for r in report["runs"]:
        lc = r["lossless_check"]
        runs.append({"name": r["name"], "tau": r["mean_accept_len"],
                     "alpha": r["per_position_accept_rate"], "speedup": r["speedup"],
                     "tok_s": r["tokens_per_s"], "ar_tok_s": r["ar_tokens_per_s"],
                     "time_split_s": r["time_split_s"],
                     "mismatched": None if lc is None else lc["mismatched"]})
    return {"batch_size": bs, "temperature": temp, "report": str(out / "report.json"), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head", required=True, help="head checkpoint dir (python -m train output)")
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--prompt-set", default="humaneval")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new", type=int, default=64, help="max new tokens per prompt")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--tree", type=int, nargs=3, default=[4, 4, 12],
                    metavar=("DEPTH", "TOPK", "TOTAL"), help="EAGLE-2 tree shape")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/bench_spec")
    args = ap.parse_args()
    if not (Path(args.head) / "config.json").is_file():
        raise SystemExit(f"--head {args.head}: no head checkpoint there (config.json missing); "
                         "train one with scripts/run_default.sh or python -m train")
    cells = [cell(args, bs, t) for bs in args.batch_sizes for t in args.temperatures]
    print(f"\n{'bs':>3} {'T':>4} {'run':<8} {'tau':>6} {'speedup':>8}  alpha")
    for c in cells:
        for r in c["runs"]:
            alpha = " ".join(f"{a:.2f}" for a in r["alpha"] if a is not None)
            print(f"{c['batch_size']:>3} {c['temperature']:>4g} {r['name']:<8} "
                  f"{r['tau'] or 0:>6.3f} {r['speedup'] or 0:>7.2f}x  {alpha}")
    print(json.dumps({"bench": "spec", "head": args.head, "prompts": args.prompts,
                      "max_new_tokens": args.new, "tree": args.tree, "cells": cells}))


if __name__ == "__main__":
    main()
