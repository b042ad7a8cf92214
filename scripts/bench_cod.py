"""P-EAGLE training steps with and without COD sampling (head.cod_ratio), same run.

Variants (each a P-EAGLE head on SmolLM2's frozen parts, V = 49152, H = 576, an 8192-token
draft vocabulary, the study's settings otherwise: conf/head/peagle.yaml with
--layers decoder layers):
  full K   every depth at every position (cod_ratio 1), K = --depths
  cod  K   COD at --ratio / --ratio-min (heads/cod.py): depth k at max(r^(k-1), r_min) of them
The trainer's step for each (head(batch) forward + backward, grad clip, AdamW), steps
alternated round-robin so load hits all alike; the batch is --tokens random ids and hidden
states in 4 packed sequences with 3 aux layers (COD's cost depends on shapes, not values). A
new draw seed each step, as training gives. Prints per variant the median step seconds, the
rows the rollout ran (N K for full, fewer for COD) and the ratio to `full K` of the largest K,
then one JSON line {"bench": "cod", ...}. Run it with nothing else on the machine.

    .venv/bin/python scripts/bench_cod.py [--depths 4 8] [--ratio 0.7 --ratio-min 0.2]
"""
from __future__ import annotations

import inference_eval  # noqa: F401  (first: its OpenBLAS setting must precede torch/numpy)

import argparse
import json
import statistics
import time

import torch

from heads.batch import PackedBatch
from heads.cod import retention
from heads.frozen import load_frozen
from heads.registry import build_head
from inference_eval.hydra_app import compose
from train.config import TrainConfig
from train.schedule import make_optimizer

VOCAB = 8192


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--ratio", type=float, default=0.7)
    ap.add_argument("--ratio-min", type=float, default=0.2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    variants = [(f"{name} {k}", k, r) for k in args.depths
                for name, r in (("full", 1.0), ("cod", args.ratio))]
    cfgs, steps = {}, {}
    parts = None
    for name, k, r in variants:
        cfg = compose("train", TrainConfig, [
            "target=smollm2", "head=peagle", f"head.num_steps={k}", f"head.num_layers={args.layers}",
            f"head.draft_vocab_size={VOCAB}", "head.aux_layers=[1,14,26]", f"head.cod_ratio={r}",
            f"head.cod_ratio_min={args.ratio_min if r < 1 else 0.0}", "data.shards=unused"])
        parts = parts or load_frozen(cfg.target)
        head = build_head(cfg.head, parts, torch.arange(VOCAB), seed=0).float().train()
        params = [p for p in head.parameters() if p.requires_grad]
        steps[name] = (head, params, make_optimizer(params, cfg.optim), cfg.optim.grad_clip)
        cfgs[name] = (k, r)
    g = torch.Generator().manual_seed(0)
    n, h = args.tokens, parts.arch.hidden_size
    lens = [n // 4] * 3 + [n - 3 * (n // 4)]
    batch = PackedBatch(torch.randint(0, VOCAB, (n,), generator=g), 4.0 * torch.randn(n, h, generator=g),
                        torch.rand(n, generator=g) > 0.2, lens, 4.0 * torch.randn(n, 3, h, generator=g))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(args.warmup + args.steps):
        batch.draw_seed = i
        for name, (head, params, opt, clip) in steps.items():
            t = time.perf_counter()
            loss, _ = head(batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t)
    med = {name: statistics.median(v) for name, v in times.items()}
    base = f"full {max(args.depths)}"
    rows = {name: round(n * sum(retention(j, r, args.ratio_min) if r < 1 else 1.0
                                for j in range(1, k + 1))) for name, (k, r) in cfgs.items()}
    print(f"P-EAGLE ({args.layers} layers) train step, {n} tokens, median of {args.steps}:")
    for name in steps:
        print(f"  {name:<7} {med[name]:7.3f} s  rows ~{rows[name]:>6}  {med[name] / med[base]:5.2f}x {base}")
    print(json.dumps({"bench": "cod", "tokens": n, "layers": args.layers, "ratio": args.ratio,
                      "ratio_min": args.ratio_min, "step_s": {k: round(v, 4) for k, v in med.items()},
                      "rows": rows, "ratio_to_" + base.replace(" ", "_"):
                      {k: round(v / med[base], 3) for k, v in med.items()}}))


if __name__ == "__main__":
    main()
