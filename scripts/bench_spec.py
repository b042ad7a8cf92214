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
table, then one JSON line: {"bench": "spec", "step_costs": {...}, "cells": [{"batch_size",
"temperature", "runs": [{"name", "tau", "alpha", "speedup", "tok_s", "ar_tok_s",
"time_split_s", "mismatched"}]}]}.

Step costs first (batch 1, `--context` cached tokens, the engine's own model, cache, backend
and GEMM paths): one autoregressive decode step (1 token in, logits for it), verification
of K + 1 tokens (K = 1..4, logits for every row), verification of a tree of the --tree shape
(root plus `total` nodes under an ancestor mask), one draft step of the head (1 token, the
head's lm_head: its reduced vocabulary when it has one) and one draft-tree level (`topk`
nodes at once under their scratch mask). They are timed round-robin
--step-reps times, so drift hits them alike; ratios are medians over the AR step's median.
`--steps-only` stops after them.

`--host-time` (no --head needed) measures what a GPU cannot hide by running faster: the
host work of a step, i.e. its wall time less the time inside model passes (the target's
forward, the head's step and lm_head), on the tiny random target (`target=tiny`, eager,
batch 1 and --host-batch) with a random MTP head. It reports the host ms of an
autoregressive decode step and of a chain round (K = 2 and 4), their ratio, and the round's
host time split by phase (schedule, draft, verify, catch-up). Drafts are rarely accepted
with a random head; a round's host work barely depends on how many are.
"""
from __future__ import annotations

import inference_eval  # noqa: F401  (first: its OpenBLAS setting must precede torch/numpy)

import argparse
import json
from pathlib import Path

import statistics
import time
from dataclasses import replace

import torch

from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.speculative.draft_cut import round_costs
from inference_eval.engine.speculative.tree import tree_attention_mask
from inference_eval.engine.target import load_target
from inference_eval.evaluation import evaluate
from inference_eval.evaluation.config import EvalConfig
from inference_eval.evaluation.engines import build_engine
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
        f"engine.seed={args.seed}", *args.engine])
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


def _tree_shape(depth: int, topk: int, total: int) -> tuple[list[int], list[int]]:
    """A tree of the --tree shape for the step costs: the root, then `topk` children per
    level under the previous level's first node, to `depth` levels or total + 1 nodes.
    Returns (parent index per node, -1 for the root; depth per node)."""
    parents, depths, best = [-1], [0], 0
    while len(parents) <= total and depths[best] < depth:
        first = len(parents)
        for _ in range(min(topk, total + 1 - len(parents))):
            parents.append(best)
            depths.append(depths[best] + 1)
        best = first
    return parents, depths


@torch.inference_mode()
def step_costs(args: argparse.Namespace) -> dict:
    """Median/min ms of an AR step, a K+1-token verification and a head draft step (module
    docstring), at batch 1 after --context cached tokens; ratios against the AR step."""
    from types import SimpleNamespace

    cfg = compose("eval", EvalConfig, [f"target={args.target}", *args.engine])
    device = cfg.engine.resolve_device()
    loaded = load_target(cfg.target, device=device)
    draft = SimpleNamespace(kind="head", checkpoint=args.head, scheme="chain", num_draft=4)
    eng = build_engine(loaded, cfg.engine, draft)
    eng.warm(1)  # engine.compile: rows 1..5 compiled before anything is timed
    model, drafter, ps, ctx = eng.model, eng.drafter, eng.cfg.page_size, args.context
    span = ctx + max(8, args.tree[2] + 2)  # the context plus the most rows one step adds
    pages = list(range(span // ps + 1))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.arch.vocab_size, (span,), generator=gen).to(device)

    def layout(q: int, kv: int) -> BatchLayout:
        return BatchLayout([q], [kv], [pages], ps)

    # Fill both caches once so every timed step attends over `ctx` real entries.
    out = model(ids[:ctx], eng.backend.plan(layout(ctx, ctx)), eng.cache, compute_logits=False,
                aux_layers=drafter.aux_layers)  # an EAGLE-3 head reads the aux layers too
    hidden = drafter.head.first_hidden(out.hidden, out.aux)
    drafter.run(ids[1:ctx + 1], hidden, eng.backend.plan(layout(ctx, ctx)),
                rows=torch.tensor([ctx - 1], device=device))
    state = hidden[-1:]

    def target(q: int):
        return lambda: model(ids[ctx:ctx + q], eng.backend.plan(layout(q, ctx + q)), eng.cache)

    depth_d, topk, total = args.tree
    parents, depth = _tree_shape(depth_d, topk, total)
    tree_mask = tree_attention_mask(torch.tensor(parents), torch.ones(len(parents), dtype=torch.bool))
    tree_pos = torch.tensor([ctx + d for d in depth])

    def verify_tree():
        n = len(parents)
        lay = BatchLayout([n], [ctx + n], [pages], ps, positions=tree_pos, tree_masks=[tree_mask])
        return model(ids[ctx:ctx + n], eng.backend.plan(lay), eng.cache)

    rows = torch.full((topk,), ctx)
    frontier_state = state.expand(topk, -1).contiguous()

    def draft_frontier():  # one tree level: `topk` nodes through the head at once
        lay = BatchLayout([topk], [ctx + topk], [pages], ps, positions=rows,
                          tree_masks=[torch.eye(topk, dtype=torch.bool)])
        return drafter.run(ids[ctx:ctx + topk], frontier_state, eng.backend.plan(lay), k=2)

    ops = {"ar_step": target(1), **{f"verify_{k + 1}": target(k + 1) for k in range(1, 5)},
           f"verify_tree_{len(parents)}": verify_tree,
           "draft_step": lambda: drafter.run(ids[ctx:ctx + 1], state,
                                             eng.backend.plan(layout(1, ctx + 1)), k=2),
           f"draft_{topk}_rows": draft_frontier}
    times: dict[str, list[float]] = {name: [] for name in ops}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with eng.step_threads():  # the engine's own thread setting inside a step
        for rep in range(args.step_reps + 2):
            for name, fn in ops.items():
                sync()
                t = time.perf_counter()
                fn()
                sync()  # on a GPU: the step's kernels, not only their launches
                if rep >= 2:  # two warm-up rounds
                    times[name].append(time.perf_counter() - t)
    med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    res = {"context": ctx, "reps": args.step_reps, "threads": torch.get_num_threads(),
           "draft_vocab": int(drafter.head.lm_head_weight.shape[0]),
           "median_ms": {n: round(v, 2) for n, v in med.items()},
           "min_ms": {n: round(min(v) * 1e3, 2) for n, v in times.items()},
           "ratio_to_ar": {n: round(v / med["ar_step"], 3) for n, v in med.items()}}
    # A chain round of s drafts (K=4), in AR steps: draft.round_costs for confidence_cut=rate
    # (draft_cut.round_costs), the refill that gives d_1 counted as one draft step
    # (bench_block_pass.py times the refill itself).
    ratio = res["ratio_to_ar"]
    verify = [1.0] + [ratio[f"verify_{r}"] for r in range(2, 6)]
    step = ratio["draft_step"]
    res["round_costs"] = [round(c, 3) for c in round_costs(verify, step, step=step)]
    print(f"step costs at context {ctx} ({res['threads']} threads, median of {args.step_reps}):")
    for n in ops:
        print(f"  {n:<11} {med[n]:8.2f} ms  {ratio[n]:6.3f}x AR"
              f"  (min {res['min_ms'][n]:.2f} ms)")
    print(f"  chain rounds of 0..4 drafts: draft.round_costs={res['round_costs']} "
          "(draft.confidence_cut=rate)")
    return res


class _ModelClock:
    """Seconds spent inside model passes, charged to the engine phase running them: the
    target's forward (hooks) and a head's step / lm_head (wrapped methods)."""

    def __init__(self) -> None:
        self.phase, self.spent, self._t0 = "other", {}, 0.0

    def _add(self, dt: float) -> None:
        self.spent[self.phase] = self.spent.get(self.phase, 0.0) + dt

    def attach_module(self, module: torch.nn.Module) -> None:
        def pre(*_):
            self._t0 = time.perf_counter()

        def post(*_):
            self._add(time.perf_counter() - self._t0)
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    def wrap(self, obj, name: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self._add(time.perf_counter() - t)
        setattr(obj, name, timed)

    def in_phase(self, obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def tagged(*a, **kw):
            before, self.phase = self.phase, phase
            try:
                return fn(*a, **kw)
            finally:
                self.phase = before
        setattr(obj, name, tagged)


def _host_of(eng, clock: _ModelClock, prompts: list[list[int]], new: int) -> tuple[list, dict]:
    """Runs `prompts` through `eng` (greedy, `new` tokens each) and returns per decode step
    (a round, for a speculative engine): (each request's tokens, {wall ms, model ms, host ms
    (wall - model), host ms by phase, steps, tokens}). Prefill steps are left out."""
    from inference_eval.engine.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    reqs = [eng.add_request(p, params) for p in prompts]
    phases = ("draft", "verify", "catch_up")
    wall = model = 0.0
    by_phase = {p: 0.0 for p in ("schedule", *phases)}
    steps = tokens = 0
    schedule, seen = eng.scheduler.schedule, []

    def watched():  # whether the step about to run prefills any request
        batch = schedule()
        seen.append(any(r.prefills(q) for r, q in zip(batch.requests, batch.q_lens)))
        return batch
    eng.scheduler.schedule = watched
    while eng.scheduler.has_work:
        seen.clear()
        clock.spent.clear()
        timing = dict(getattr(eng, "timing", {}))
        before = sum(len(r.output_ids) for r in reqs)
        t = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t
        if not seen or seen[0]:
            continue
        steps += 1
        tokens += sum(len(r.output_ids) for r in reqs) - before
        wall += dt
        spent = sum(clock.spent.values())
        model += spent
        if "draft" in timing:
            for p in phases:
                by_phase[p] += (eng.timing[p] - timing[p]) - clock.spent.get(p, 0.0)
            by_phase["schedule"] += dt - sum(eng.timing[p] - timing[p] for p in phases) \
                - clock.spent.get("other", 0.0)
    eng.scheduler.schedule = schedule
    ms = lambda x: round(x / max(steps, 1) * 1e3, 3)  # noqa: E731
    stats = {"steps": steps, "tokens": tokens, "wall_ms": ms(wall), "model_ms": ms(model),
             "host_ms": ms(wall - model),
             "host_ms_by_phase": {k: ms(v) for k, v in by_phase.items()} if steps else {},
             "tokens_per_step": round(tokens / max(steps, 1), 3)}
    return [r.output_ids for r in reqs], stats


@torch.inference_mode()
def host_costs(args: argparse.Namespace) -> dict:
    """The host time of an AR decode step and of chain rounds K = 2, 4 (module docstring)."""
    import tempfile
    from types import SimpleNamespace

    from heads.checkpoint import save_head
    from heads.config import HeadConfig
    from heads.registry import build_head
    from inference_eval.evaluation.engines import frozen_parts_of

    cfg = compose("eval", EvalConfig, ["target=tiny", *args.engine])
    loaded = load_target(cfg.target, device=cfg.engine.resolve_device(), with_tokenizer=False)
    gen = torch.Generator().manual_seed(args.seed)
    res: dict = {"target": "tiny", "new_tokens": args.new}
    with tempfile.TemporaryDirectory() as tmp:
        save_head(build_head(HeadConfig(type="mtp", num_steps=1), frozen_parts_of(loaded),
                             seed=args.seed), Path(tmp) / "head")
        for bs in sorted({1, args.host_batch}):
            prompts = [torch.randint(3, 20000, (int(torch.randint(16, 64, (1,), generator=gen)),),
                                     generator=gen).tolist() for _ in range(bs * args.host_reps)]
            cell, outs = {}, {}
            for name, k in (("ar", 0), ("chain2", 2), ("chain4", 4)):
                draft = SimpleNamespace(kind="none") if k == 0 else SimpleNamespace(
                    kind="head", checkpoint=str(Path(tmp) / "head"), num_draft=k, scheme="chain")
                eng = build_engine(loaded, replace(cfg.engine, max_batch_size=bs), draft)
                clock = _ModelClock()
                clock.attach_module(eng.model)
                if k:
                    d = eng.drafter
                    clock.wrap(d.head, "step")
                    clock.wrap(d.head, "logits")
                    # A round's model time outside drafting and catch-up is its verify pass.
                    clock.in_phase(eng, "_decode", "verify")
                    clock.in_phase(eng, "_propose", "draft")
                    clock.in_phase(eng, "_prefill", "prefill")
                    for verb in ("verified", "accept"):
                        clock.in_phase(d, verb, "catch_up")
                _host_of(eng, clock, prompts[:bs], 8)  # warm-up: first calls, allocations
                outs[name], cell[name] = _host_of(eng, clock, prompts, args.new)
            ar = cell["ar"]["host_ms"]
            for name in ("chain2", "chain4"):
                cell[name]["host_ratio_to_ar"] = round(cell[name]["host_ms"] / ar, 3)
                cell[name]["mismatched"] = sum(a != b for a, b in zip(outs[name], outs["ar"]))
            res[f"bs{bs}"] = cell
            print(f"host time per step, tiny target, batch {bs} (ms; wall = model + host):")
            for name, c in cell.items():
                split = " ".join(f"{p} {v:.3f}" for p, v in c["host_ms_by_phase"].items()) \
                    if name != "ar" else ""
                print(f"  {name:<7} wall {c['wall_ms']:7.3f}  model {c['model_ms']:7.3f}  "
                      f"host {c['host_ms']:7.3f}  ({c.get('host_ratio_to_ar', 1.0):.2f}x AR; "
                      f"{c['tokens_per_step']:.2f} tok/step)  {split}")
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head", help="head checkpoint dir (python -m train output)")
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
    ap.add_argument("--context", type=int, default=256, help="cached tokens for the step costs")
    ap.add_argument("--step-reps", type=int, default=20)
    ap.add_argument("--steps-only", action="store_true", help="measure the step costs only")
    ap.add_argument("--engine", nargs="*", default=[], metavar="KEY=VALUE",
                    help="engine overrides for the step costs and the runs, e.g. "
                         "engine.compile=true or engine.cpu_blas=torch")
    ap.add_argument("--host-time", action="store_true",
                    help="measure the host time of AR steps and chain rounds on the tiny target")
    ap.add_argument("--host-batch", type=int, default=8, help="the second batch size of --host-time")
    ap.add_argument("--host-reps", type=int, default=4, help="--host-time: prompts per batch slot")
    args = ap.parse_args()
    if args.host_time:
        print(json.dumps({"bench": "spec_host", **host_costs(args)}))
        return
    if args.head is None:
        raise SystemExit("--head is required (or --host-time)")
    if not (Path(args.head) / "config.json").is_file():
        raise SystemExit(f"--head {args.head}: no head checkpoint there (config.json missing); "
                         "train one with scripts/run_default.sh or python -m train")
    costs = step_costs(args)
    if args.steps_only:
        print(json.dumps({"bench": "spec", "head": args.head, "step_costs": costs}))
        return
    cells = [cell(args, bs, t) for bs in args.batch_sizes for t in args.temperatures]
    print(f"\n{'bs':>3} {'T':>4} {'run':<8} {'tau':>6} {'speedup':>8}  alpha")
    for c in cells:
        for r in c["runs"]:
            alpha = " ".join(f"{a:.2f}" for a in r["alpha"] if a is not None)
            print(f"{c['batch_size']:>3} {c['temperature']:>4g} {r['name']:<8} "
                  f"{r['tau'] or 0:>6.3f} {r['speedup'] or 0:>7.2f}x  {alpha}")
    print(json.dumps({"bench": "spec", "head": args.head, "step_costs": costs, "prompts": args.prompts,
                      "max_new_tokens": args.new, "tree": args.tree, "cells": cells}))


if __name__ == "__main__":
    main()
