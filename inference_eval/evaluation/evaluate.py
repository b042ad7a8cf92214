"""`python -m inference_eval`: how many tokens do the drafts let the target accept, and how
much faster is it, on the engine itself.

    python -m inference_eval target=smollm2 draft=none prompts=humaneval prompts.limit=8 \
        output_dir=runs/eval
    python -m inference_eval target=smollm2 draft=head draft.checkpoint=runs/head \
        prompts=sharegpt_heldout eval.batch_size=4

One run per engine, all on the same prompts and settings: the autoregressive baseline first
(ar_tokens_per_s, speedup, lossless check), then every requested draft; `eval.repeats`
passes over them all, interleaved, for the speed figures. Prompts run turn by turn; turn t
of every run replays the baseline's earlier answers as its history, so all runs decode
after the same contexts. Writes output_dir/report.{json,md}, PNGs and outputs.jsonl (see
report.py).
"""
from __future__ import annotations

import gc
import platform
import time
from contextlib import contextmanager
from dataclasses import asdict, replace
from typing import Any, Callable, Iterator, Sequence

import torch

from heads.checkpoint import read_head_config
from inference_eval.evaluation.lookup_corpus import corpus_manifests
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import GenerationResult
from inference_eval.evaluation.engines import build_engine
from inference_eval.evaluation.config import BASELINE_LABEL, DraftConfig, EvalConfig
from inference_eval.evaluation.metrics import TurnOutput
from inference_eval.evaluation.prompts import PromptItem, load_prompts
from inference_eval.evaluation.report import (
    RunResult,
    build_report,
    format_difference,
    format_interval,
    write_report,
)
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.target import LoadedTarget, load_target


def free_device_memory() -> None:
    """Return a dropped engine's KV cache to CUDA now. Not on CPU: there refcounting frees
    it, and a full gc.collect() over transformers' object graph costs ~0.6 s (measured)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


class Runner:
    """Generates with one engine, rebuilding it after a failure: an exception inside a step
    can leave the scheduler and page allocator holding dead requests."""

    def __init__(self, make: Callable[[], Any], chat: bool, progress: bool) -> None:
        self.make, self.chat, self.progress = make, chat, progress
        self.engine = make()

    def generate(self, prompts: Sequence[Any], params: SamplingParams) -> list[GenerationResult]:
        """One result per prompt, always: a batch that raises is retried prompt by prompt,
        so one failing prompt costs only its own result (error set)."""
        try:
            return self.engine.generate(list(prompts), params, chat=self.chat,
                                        progress=self.progress)
        except Exception as exc:  # noqa: BLE001 - recorded per prompt, never swallowed silently
            self.engine = None
            free_device_memory()
            self.engine = self.make()
            if len(prompts) == 1:
                return [GenerationResult(0, [], [], finish_reason="error",
                                         error=f"{type(exc).__name__}: {exc}")]
            return [r for p in prompts for r in self.generate([p], params)]


def turn_prompt(history: list[dict[str, str]], user: str, chat: bool) -> Any:
    """The prompt of the next turn: messages for the chat template, or (chat=False) the
    conversation so far as plain text (encode_prompt templates any message list)."""
    messages = history + [{"role": "user", "content": user}]
    return messages if chat else "\n\n".join(m["content"] for m in messages)


Replay = dict[tuple[str, int], str]  # (prompt id, turn) -> the answer later turns see


def run_items(runner: Runner, items: Sequence[PromptItem], params: SamplingParams,
              replay: Replay | None = None) -> tuple[list[TurnOutput], float]:
    """All turns of all items; returns (outputs ordered by turn then item, generate wall s).

    Turn t of every item that has one is queued at once (the engine batches up to
    eval.batch_size); an item whose turn failed gets its later turns as skipped errors.
    replay: the answers earlier turns are given in the history (the baseline's), instead of
    this run's own."""
    history: dict[str, list[dict[str, str]]] = {it.id: [] for it in items}
    failed: dict[str, int] = {}
    outputs: list[TurnOutput] = []
    wall = 0.0
    for t in range(max(len(it.turns) for it in items)):
        live = [it for it in items if len(it.turns) > t and it.id not in failed]
        outputs += [TurnOutput(it.id, it.category, t, error=f"skipped: turn {failed[it.id]} "
                               "failed") for it in items if len(it.turns) > t and it.id in failed]
        if not live:
            continue
        prompts = [turn_prompt(history[it.id], it.turns[t], runner.chat) for it in live]
        t0 = time.perf_counter()
        results = runner.generate(prompts, params)
        wall += time.perf_counter() - t0
        for it, res in zip(live, results):
            out = TurnOutput.from_result(it.id, it.category, t, res)
            outputs.append(out)
            if not out.ok:
                failed[it.id] = t
            own = res.text or ""
            answer = own if replay is None else replay.get((it.id, t), own)
            history[it.id] += [{"role": "user", "content": it.turns[t]},
                               {"role": "assistant", "content": answer}]
    return outputs, wall


def run_one(loaded: LoadedTarget, engine_cfg: EngineConfig, draft: DraftConfig,
            items: Sequence[PromptItem], cfg: EvalConfig, replay: Replay | None = None,
            make: Callable[[], Any] | None = None) -> RunResult:
    """make: the engine factory (default: build_engine; tensor parallelism serves its own)."""
    runner = Runner(make or (lambda: build_engine(loaded, engine_cfg, draft)), cfg.eval.chat,
                    cfg.eval.progress)
    if cfg.eval.warmup:
        runner.engine.warm(cfg.eval.batch_size)  # engine.compile: no compile inside the timing
        warm = replace(cfg.sampling, max_new_tokens=min(8, cfg.sampling.max_new_tokens))
        runner.generate([turn_prompt([], items[0].turns[0], cfg.eval.chat)], warm)
    for stats in (getattr(runner.engine, "timing", None), getattr(runner.engine, "counters", None)):
        if stats is not None:
            stats.update({k: 0 * v for k, v in stats.items()})  # the measured prompts only
    outputs, wall = run_items(runner, items, cfg.sampling, replay)
    # A rebuilt engine (after a failing prompt) restarts its timing; the split is then partial.
    split = dict(getattr(runner.engine, "timing", None) or {})
    counters = dict(getattr(runner.engine, "counters", None) or {})
    runner.engine = None  # free its KV cache before the next run allocates one
    free_device_memory()
    return RunResult(draft.label, draft.report_scheme, asdict(draft), outputs, wall, split,
                     counters=counters)


def combine_passes(passes: list[RunResult]) -> RunResult:
    """One run from its timed passes: the first pass's outputs, the median pass's wall time
    and time split, every pass's wall time (wall_s_passes) for the best and the spread."""
    walls = [p.wall_s for p in passes]
    median = sorted(range(len(passes)), key=walls.__getitem__)[(len(passes) - 1) // 2]
    first = passes[0]
    return replace(first, wall_s=walls[median], time_split_s=passes[median].time_split_s,
                   wall_s_passes=walls)


def settings_of(cfg: EvalConfig, loaded: LoadedTarget, items: Sequence[PromptItem],
                engine_cfg: EngineConfig, device: torch.device) -> dict[str, Any]:
    """The exact settings every run shared (written into report.json and report.md)."""
    ident = {k: loaded.identity.get(k) for k in ("name", "source", "path", "weights_sha256")}
    return {
        "target": {**ident, "dtype": cfg.target.dtype},
        "drafts": [asdict(d) for d in cfg.draft_runs()],
        "sampling": asdict(cfg.sampling),
        "batch_size": cfg.eval.batch_size,
        "repeats": cfg.eval.repeats,
        "max_new_tokens": cfg.sampling.max_new_tokens,
        "prompts": {**asdict(cfg.prompts), "num_items": len(items),
                    "num_turns": sum(len(it.turns) for it in items)},
        "chat": cfg.eval.chat,
        "engine": asdict(engine_cfg),
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "host": platform.node(),
    }


def main(cfg: EvalConfig) -> dict[str, Any]:
    items = load_prompts(cfg.prompts)
    drafts = cfg.draft_runs()
    for d in drafts:  # fail now, not after the baseline has run for an hour
        if d.kind == "head":
            read_head_config(d.checkpoint)
        if d.lookup_corpus is not None:
            corpus_manifests(d.lookup_corpus)
    if cfg.engine.tensor_parallel > 1:
        return _main_tensor_parallel(cfg, items, drafts)
    device = cfg.engine.resolve_device()
    loaded = load_target(cfg.target, device=device)
    engine_cfg = replace(cfg.engine, max_batch_size=cfg.eval.batch_size)

    @contextmanager
    def session(draft: DraftConfig) -> Iterator[Callable[[], Any]]:
        yield lambda: build_engine(loaded, engine_cfg, draft)
    runs = _run_all(cfg, items, drafts, loaded, session, leader=True)
    return _write(cfg, runs, loaded, items, device)


def _main_tensor_parallel(cfg: EvalConfig, items: Sequence[PromptItem],
                          drafts: list[DraftConfig]) -> dict[str, Any]:
    """Under torchrun: world / engine.tensor_parallel replicas, each running every run on
    its share of the prompts (parallel/replicas.py). Every run is one parallel.runner.serve
    session per replica: its leader schedules, drafts and samples; the others run their
    shard of the target (and of a head: evaluation.engines build_tp_spec_engine) for each of
    its calls. Global rank 0 merges the replicas' runs and writes the report; every other
    rank returns {}."""
    from inference_eval.engine.parallel.group import close_tensor_parallel, init_tensor_parallel
    from inference_eval.engine.parallel.replicas import gather_to_first, leaders_group, share
    from inference_eval.engine.parallel.runner import load_tp_target, serve
    from inference_eval.evaluation.engines import build_tp_spec_engine
    from inference_eval.evaluation.report import merge_replicas

    size = cfg.engine.tensor_parallel
    tp = init_tensor_parallel(size, cfg.engine.device, cfg.engine.tp_timeout_s)
    engine_cfg = replace(cfg.engine, max_batch_size=cfg.eval.batch_size)  # as _run_all's
    try:
        leaders = leaders_group(tp)
        mine = share(items, tp, "prompts")
        loaded, plan = load_tp_target(cfg.target, tp, with_tokenizer=tp.is_leader,
                                      expert_parallel=cfg.engine.expert_parallel)

        @contextmanager
        def session(draft: DraftConfig) -> Iterator[Callable[[], Any] | None]:
            build, make_drafter = build_tp_spec_engine(loaded, plan, tp, draft)
            with serve(loaded, plan, engine_cfg, tp, build, make_drafter) as engine:
                yield None if engine is None else _once(engine)
        runs = _run_all(cfg, mine, drafts, loaded, session, tp.is_leader)
        parts = gather_to_first(runs, tp, leaders) if tp.is_leader else None
    finally:
        close_tensor_parallel()
    if parts is None:
        return {}
    runs = merge_replicas(parts, [it.id for it in items]) if len(parts) > 1 else parts[0]
    return _write(cfg, runs, loaded, items, tp.device)


def _once(engine) -> Callable[[], Any]:
    """The served engine, once: a step that failed under tensor parallelism may have left the
    followers inside a collective, so the run stops (serve stops them) instead of retrying."""
    calls = []

    def make():
        if calls:
            raise RuntimeError("a step failed under engine.tensor_parallel > 1; the run stops "
                               "(the failing prompt cannot be retried alone)")
        calls.append(1)
        return engine
    return make


def _run_all(cfg: EvalConfig, items: Sequence[PromptItem], drafts: list[DraftConfig],
             loaded: LoadedTarget, session, leader: bool) -> list[RunResult] | None:
    """Every run in order, each inside session(draft), which yields its engine factory (None
    on a tensor-parallel follower, which only serves the run; it returns None). Returns the
    runs, baseline first, each combined over its eval.repeats passes."""
    # The engine's max batch IS the benchmark's concurrency, identical for every run.
    engine_cfg = replace(cfg.engine, max_batch_size=cfg.eval.batch_size)
    if leader:
        print(f"{len(items)} prompts ({sum(len(it.turns) for it in items)} turns), runs: "
              f"{[BASELINE_LABEL] + [d.label for d in drafts]}")
    order = [DraftConfig(kind="none", name=BASELINE_LABEL)] + drafts
    passes: list[list[RunResult]] = [[] for _ in order]
    replay: Replay | None = None
    for rep in range(cfg.eval.repeats):
        for i, draft in enumerate(order):
            with session(draft) as make:
                if make is None:
                    continue
                res = run_one(loaded, engine_cfg, draft, items, cfg, replay, make)
            passes[i].append(res)
            if replay is None:  # the baseline's first pass: every later run replays it
                replay = {(o.prompt_id, o.turn): o.text or "" for o in res.outputs if o.ok}
            print(f"[{draft.label}] {len(res.outputs)} outputs in {res.wall_s:.1f}s"
                  + (f" (pass {rep + 1}/{cfg.eval.repeats})" if cfg.eval.repeats > 1 else ""))
    return [combine_passes(p) for p in passes] if leader else None


def _write(cfg: EvalConfig, runs: list[RunResult], loaded: LoadedTarget,
           items: Sequence[PromptItem], device: torch.device) -> dict[str, Any]:
    engine_cfg = replace(cfg.engine, max_batch_size=cfg.eval.batch_size)
    report = build_report(runs, settings_of(cfg, loaded, items, engine_cfg, device))
    paths = write_report(report, cfg.output_dir, runs)
    print_summary(report)
    print(f"report: {paths['json']} ({paths['md'].name}, plots, outputs.jsonl beside it)")
    return report


def print_summary(report: dict[str, Any]) -> None:
    for r in report["runs"]:
        alpha = ", ".join("-" if a is None else f"{a:.2f}" for a in r["per_position_accept_rate"])
        lc = r["lossless_check"]
        tau, tps, sp = r["mean_accept_len"], r["tokens_per_s"], r["speedup"]
        sure = ("" if r["scheme"] == "ar" or not r.get("tau_ci95") else
                f" (95% {format_interval(r['tau_ci95'])}"
                + (f"; vs {report['primary']} {format_difference(r['tau_vs_primary'])}"
                   if r.get("tau_vs_primary") else "") + ")")
        print(f"[{r['name']}] τ={'-' if tau is None else f'{tau:.3f}'}{sure}  α=[{alpha}]  "
              f"tok/s={'-' if tps is None else f'{tps:.1f}'}  "
              f"speedup={'-' if sp is None else f'{sp:.2f}x'}"
              + ("" if r["scheme"] == "ar" or r.get("decode_speedup") is None else
                 f" (decode {r['decode_speedup']:.2f}x)")
              + ("" if lc is None or r["scheme"] == "ar" else
                 f"  lossless mismatched {lc['mismatched']}/{lc['compared']}")
              + (f"  errors={r['num_errors']}" if r["num_errors"] else ""))
