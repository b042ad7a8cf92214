"""What a block drafter's one pass costs against a chain head's draft step, on the engine.

The chain head drafts K tokens with K sequential steps (the first comes out of the refill
after verification, the other K - 1 are `step` calls); a block drafter drafts them all in
the one pass its `begin_round` runs (DFlash: the block of B = K + 1 rows; P-EAGLE: the K - 1
mask rows, d_1 still coming from its refill). This times, at batch 1 after --context cached
tokens, the drafters' own verbs as the chain engine calls them:

- `chain_step`:   a chain head's `step` (one draft: 1 row through the head, its lm_head);
- `chain_refill`: its refill after verification with --accepted drafts taken (a + 1 rows);
- `dflash{B}_pass`:  a DFlash head's `begin_round` (the whole block of B rows, laws of
  d_1..d_{B-1}), for each --dflash head;
- `dflash{B}_context`: its context write after verification (a + 1 rows of aux states);
- `peagle_pass`:  a P-EAGLE head's `begin_round` and first `step` (d_2..d_K in one pass,
  which waits for d_1's cut);
- `peagle_refill`: its refill (as chain_refill; gives d_1);
- `ar_step`, `verify_{r}`: the target's pass over 1 and r = 2..K+1 rows (logits for each).

Ops run round-robin --reps times under the engine's thread setting, so drift hits them
alike; medians are reported with their ratio to `chain_step` (the issue's goal: one block
pass <= 1.5x one chain draft step), and the draft work of a whole round,
refill + (K - 1) steps for the chain, context + pass for DFlash, refill + pass for P-EAGLE
(a DFlash head of another block size than K + 1 drafts B - 1 tokens a round instead).

It also prints each drafter's `draft.round_costs` for `draft.confidence_cut=rate`: c_s, the
time of a round that verifies s drafts, in AR steps, its draft work as the engine does it
(verify_0 = ar_step):
  chain    c_s = refill + min(s, K-1) steps + verify_s  (a kept draft's successor is drafted
           before the cut judges it);
  P-EAGLE  c_0 = refill + ar_step, c_s = refill + pass + verify_s for s >= 1;
  DFlash   c_s = context + pass + verify_s (its pass gives d_1 too).

    .venv/bin/python scripts/bench_block_pass.py [--chain runs/block_study/eagle3/checkpoints/best]
        [--dflash .../dflash4/... [.../dflash8/...]] [--peagle .../peagle/...] [--context 256] [--reps 60]
        [--accepted 1] [--engine KEY=VALUE ...]

Prints a table, then one JSON line {"bench": "block_pass", ...}.
"""
from __future__ import annotations

import inference_eval  # noqa: F401  (first: its OpenBLAS setting must precede torch/numpy)

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.speculative.draft_cut import round_costs as cut_costs
from inference_eval.engine.target import load_target
from inference_eval.evaluation.config import EvalConfig
from inference_eval.evaluation.engines import build_engine
from inference_eval.hydra_app import compose

STUDY = "runs/block_study"


def _ops(name: str, eng, ctx: int, accepted: int, k: int) -> dict:
    """name: chain, peagle or dflash{B}."""
    """The timed callables of one drafter, its caches filled with `ctx` positions."""
    model, dr, ps = eng.model, eng.drafter, eng.cfg.page_size
    span = ctx + 2 * (k + 2)
    pages = list(range(span // ps + 1))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.arch.vocab_size, (span,), generator=gen)
    req = SimpleNamespace(id=0, pages=pages, token_ids=ids[:ctx + 1].tolist())

    def layout(q: int, kv: int) -> BatchLayout:
        return BatchLayout([q], [kv], [pages], ps)

    out = model(ids[:ctx], eng.backend.plan(layout(ctx, ctx)), eng.cache,
                compute_logits=False, aux_layers=dr.aux_layers)
    prefill = layout(ctx, ctx)
    dr.prefill([req], prefill, eng.backend.plan(prefill), [ids[:ctx].tolist()],
               [int(ids[ctx])], out)
    rows = [list(range(ctx - accepted - 1, ctx))]  # the verified rows a round's refill reads
    emitted = [ids[ctx - accepted:ctx + 1].tolist()]
    n = [ctx - accepted - 1]  # n + a + 1 = ctx: the refill rewrites the last a + 1 positions

    def accept():
        dr.accept([req], n, [accepted], emitted, out, rows)

    if name == "chain":
        state = dr.begin_round([req], [ctx])[0]
        tok = ids[ctx:ctx + 1]
        return {"chain_step": lambda: dr.step([req], [ctx], 1, tok, state),
                "chain_refill": accept}
    if name == "peagle":
        dr.draft_lengths([req], [ctx], [k])
        tok = ids[ctx:ctx + 1]

        def mask_pass():  # the verbs a round that keeps d_1 calls: the pass runs in step 1
            dr.step([req], [ctx], 1, tok, dr.begin_round([req], [ctx])[0])

        return {"peagle_pass": mask_pass, "peagle_refill": accept}
    return {f"{name}_pass": lambda: dr.begin_round([req], [ctx]), f"{name}_context": accept}


def _target_ops(eng, ctx: int, k: int) -> dict:
    """The target's pass over 1 (an AR step) and 2..k+1 rows after `ctx` cached tokens."""
    model, ps = eng.model, eng.cfg.page_size
    span = ctx + k + 2
    pages = list(range(span // ps + 1))
    ids = torch.randint(0, model.arch.vocab_size, (span,), generator=torch.Generator().manual_seed(1))

    def plan(q: int, kv: int):
        return eng.backend.plan(BatchLayout([q], [kv], [pages], ps))

    model(ids[:ctx], plan(ctx, ctx), eng.cache, compute_logits=False)

    def rows(q: int):
        return lambda: model(ids[ctx:ctx + q], plan(q, ctx + q), eng.cache)

    return {"ar_step": rows(1), **{f"verify_{q}": rows(q) for q in range(2, k + 2)}}


def round_costs(med: dict, k: int) -> dict:
    """Each drafter's draft.round_costs [c_0..c_K] in AR steps (module docstring)."""
    verify = [med["ar_step"]] + [med[f"verify_{s + 1}"] for s in range(1, k + 1)]
    costs = {"chain": cut_costs(verify, med["chain_refill"], step=med["chain_step"]),
             "peagle": cut_costs(verify, med["peagle_refill"], kept=med["peagle_pass"])}
    for n in med:
        if n.startswith("dflash") and n.endswith("_pass"):
            d = n[:-len("_pass")]
            drafts = min(int(d[len("dflash"):]) - 1, k)
            costs[d] = cut_costs(verify[:drafts + 1], med[f"{d}_context"] + med[n])
    return {n: [round(c, 3) for c in v] for n, v in costs.items()}


def measure(args: argparse.Namespace) -> dict:
    """Median ms of every op (module docstring) and their ratios to a chain step."""
    cfg = compose("eval", EvalConfig, [f"target={args.target}", *args.engine])
    loaded = load_target(cfg.target, device=cfg.engine.resolve_device(), with_tokenizer=False)
    ops, engines = {}, []
    heads = [("chain", args.chain), ("peagle", args.peagle)] + [("dflash", d) for d in args.dflash]
    for name, ck in heads:
        # A DFlash pass drafts its whole block whatever K is (num_draft only caps rounds).
        k = 1 if name == "dflash" else args.k
        draft = SimpleNamespace(kind="head", checkpoint=ck, scheme="chain", num_draft=k)
        eng = build_engine(loaded, cfg.engine, draft)
        engines.append(eng)
        if name == "dflash":
            name = f"dflash{eng.drafter.block}"
        with torch.inference_mode(), eng.step_threads():
            ops.update(_ops(name, eng, args.context, args.accepted, args.k))
    with torch.inference_mode(), engines[0].step_threads():
        ops.update(_target_ops(engines[0], args.context, args.k))
    times: dict[str, list[float]] = {name: [] for name in ops}
    with torch.inference_mode(), engines[0].step_threads():
        for rep in range(args.reps + 3):
            for name, fn in ops.items():
                t = time.perf_counter()
                fn()
                if rep >= 3:  # warm-up rounds
                    times[name].append(time.perf_counter() - t)
    med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    step, k = med["chain_step"], args.k
    rounds = {"chain": med["chain_refill"] + (k - 1) * step,
              "peagle": med["peagle_refill"] + med["peagle_pass"]}
    for n in med:
        if n.startswith("dflash") and n.endswith("_pass"):
            d = n[:-len("_pass")]
            rounds[d] = med[f"{d}_context"] + med[n]
    return {"bench": "block_pass", "context": args.context, "k": k, "accepted": args.accepted,
            "threads": torch.get_num_threads(), "reps": args.reps,
            "median_ms": {n: round(v, 3) for n, v in med.items()},
            "min_ms": {n: round(min(v) * 1e3, 3) for n, v in times.items()},
            "ratio_to_chain_step": {n: round(v / step, 3) for n, v in med.items()},
            "round_ms": {n: round(v, 3) for n, v in rounds.items()},
            "round_costs": round_costs(med, k)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--chain", default=f"{STUDY}/eagle3/checkpoints/best")
    ap.add_argument("--dflash", nargs="+", default=[f"{STUDY}/dflash4/checkpoints/best"])
    ap.add_argument("--peagle", default=f"{STUDY}/peagle/checkpoints/best")
    ap.add_argument("--k", type=int, default=3, help="drafts per round (DFlash: B - 1)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--accepted", type=int, default=1, help="drafts taken in the refilled round")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--engine", nargs="*", default=[], metavar="KEY=VALUE",
                    help="engine overrides, e.g. engine.head_code=none")
    res = measure(ap.parse_args())
    med, ratio, rounds = res["median_ms"], res["ratio_to_chain_step"], res["round_ms"]
    print(f"block pass vs chain step: context {res['context']}, K={res['k']}, {res['accepted']} "
          f"accepted, {res['threads']} threads, median of {res['reps']}")
    for n, v in med.items():
        print(f"  {n:<16} {v:7.3f} ms  {ratio[n]:5.2f}x chain_step  (min {res['min_ms'][n]:.3f})")
    for n, v in rounds.items():
        print(f"  round draft work, {n:<7} {v:7.3f} ms  {v / rounds['chain']:5.2f}x the chain's")
    for n, c in res["round_costs"].items():
        print(f"  {n:<8} rounds of 0..{len(c) - 1} drafts: draft.round_costs={c}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
