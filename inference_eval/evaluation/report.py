"""The acceptance report: report.json, report.md, outputs.jsonl and PNG plots in output_dir.

report.json (format_version 1):
    settings: target, drafts, sampling, batch_size, max_new_tokens, prompts, engine, ...
    runs:     one entry per run, the AR baseline first (name "ar", scheme "ar"), each with
              name, scheme, draft, num_prompts, num_outputs, num_errors, generated_tokens,
              target_steps, prefill_steps, draft_steps, mean_accept_len (τ over the
              verification rounds), tokens_per_target_pass (prefills included),
              accept_len_hist, per_position_accept_rate, position_counts {attempted,
              accepted}, wall_s (the median pass), wall_s_passes (every timed pass),
              time_split_s ({prefill, decode} for the baseline, {prefill, draft, verify,
              catch_up} for speculative runs), tokens_per_s, ar_tokens_per_s, speedup (all
              from median passes), best_speedup (best pass over best baseline pass),
              decode_tokens_per_s and decode_speedup (prefill time and its tokens left out),
              host_syncs_per_round (chain engines: device-to-host reads per decode round),
              lookup_share (lookup drafting: share of decode rounds drafted by lookup),
              lossless_check {compared, mismatched, mismatches} (null unless greedy),
              by_category {category: summary}, errors [{id, turn, error}],
              tau_ci95 [lo, hi] (τ's bootstrap interval over the prompts), and for each
              draft run after the primary tau_vs_primary {diff, ci, prompts} (its τ less
              the primary's, with the paired bootstrap interval: metrics.tau_difference)
    primary:  name of the run whose keys are repeated at the top level: the first draft run,
              or the baseline when no draft ran, so report.json carries every key of
              docs/evaluation.md at its top level whatever the runs were.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from inference_eval.evaluation.metrics import (
    TurnOutput,
    by_category,
    lossless_check,
    position_counts,
    summarize,
    tau_difference,
    tau_interval,
)

FORMAT_VERSION = 1
PLOTS = ("accept_len_hist.png", "per_position_accept.png", "tau_by_category.png", "speedup.png")


@dataclass
class RunResult:
    """One engine pass over all prompts: `outputs` one per (prompt, turn); `wall_s` the
    summed wall time of its generate() calls (warmup excluded)."""

    name: str
    scheme: str  # "ar" | "chain" | "tree"
    draft: dict[str, Any]
    outputs: list[TurnOutput]
    wall_s: float
    # Seconds per phase of the engine's steps (baseline: prefill, decode; speculative:
    # prefill, draft, verify, catch_up), warmup excluded.
    time_split_s: dict[str, float] = field(default_factory=dict)
    wall_s_passes: list[float] = field(default_factory=list)  # every timed pass (eval.repeats)
    counters: dict[str, int] = field(default_factory=dict)  # chain engines: rounds, host_syncs


def merge_replicas(parts: Sequence[Sequence[RunResult]], order: Sequence[str]) -> list[RunResult]:
    """One list of runs from data-parallel replicas that ran the same runs on disjoint
    prompts at the same time (the eval at T x DP): outputs joined in `order` (prompt ids)
    within each turn; a run's wall time is its slowest replica's (the replicas run side by
    side), with that replica's time split; counters add up."""
    rank = {pid: i for i, pid in enumerate(order)}
    merged = []
    for runs in zip(*parts):
        slowest = max(runs, key=lambda r: r.wall_s)
        outputs = sorted((o for r in runs for o in r.outputs),
                         key=lambda o: (o.turn, rank[o.prompt_id]))
        passes = [max(p) for p in zip(*(r.wall_s_passes or [r.wall_s] for r in runs))]
        counters: dict[str, int] = {}
        for r in runs:
            for k, v in r.counters.items():
                counters[k] = counters.get(k, 0) + v
        merged.append(replace(slowest, outputs=outputs, wall_s_passes=passes,
                              counters=counters))
    return merged


def _decode_tps(run: "RunResult", s: dict[str, Any]) -> float | None:
    """Tokens/s of the decode phase: the prefill's time and the token each prefill emits out."""
    pre = run.time_split_s.get("prefill")
    if pre is None or run.wall_s - pre <= 0:
        return None
    return (s["generated_tokens"] - s["prefill_steps"]) / (run.wall_s - pre)


def _lookup_share(run: RunResult, s: dict[str, Any]) -> float | None:
    """Lookup drafting: the share of the requests' decode rounds whose drafts lookup found."""
    rounds = s["target_steps"] - s["prefill_steps"]
    if "lookup_rounds" not in run.counters or rounds <= 0:
        return None
    return run.counters["lookup_rounds"] / rounds


def run_summary(run: RunResult, baseline: RunResult, greedy: bool) -> dict[str, Any]:
    """The report entry of one run; speed and losslessness are measured against `baseline`."""
    s = summarize(run.outputs)
    k = len(s["per_position_accept_rate"])
    tps = s["generated_tokens"] / run.wall_s if run.wall_s > 0 else None
    base_tok = sum(len(o.token_ids) for o in baseline.outputs if o.ok)
    ar_tps = base_tok / baseline.wall_s if baseline.wall_s > 0 else None
    best = min(run.wall_s_passes or [run.wall_s])
    base_best = min(baseline.wall_s_passes or [baseline.wall_s])
    best_speedup = ((s["generated_tokens"] / best) / (base_tok / base_best)
                    if best > 0 and base_best > 0 and base_tok else None)
    dec, ar_dec = _decode_tps(run, s), _decode_tps(baseline, summarize(baseline.outputs))
    lossless = None
    if greedy:
        lossless = (lossless_check(run.outputs, baseline.outputs) if run is not baseline
                    else {"compared": 0, "mismatched": 0, "mismatches": []})
    return {
        "name": run.name, "scheme": run.scheme, "draft": run.draft, **s,
        "position_counts": position_counts(run.outputs, k),
        "wall_s": run.wall_s, "time_split_s": dict(run.time_split_s), "tokens_per_s": tps, "ar_tokens_per_s": ar_tps,
        "speedup": tps / ar_tps if tps and ar_tps else None,
        "wall_s_passes": list(run.wall_s_passes or [run.wall_s]), "best_speedup": best_speedup,
        "decode_tokens_per_s": dec, "decode_speedup": dec / ar_dec if dec and ar_dec else None,
        "host_syncs_per_round": (run.counters["host_syncs"] / run.counters["rounds"]
                                 if run.counters.get("rounds") else None),
        "lookup_share": _lookup_share(run, s),
        "lossless_check": lossless,
        "tau_ci95": tau_interval(run.outputs),
        "by_category": by_category(run.outputs, k),
        "errors": [{"id": o.prompt_id, "turn": o.turn, "error": o.error}
                   for o in run.outputs if not o.ok],
    }


def build_report(runs: Sequence[RunResult], settings: dict[str, Any]) -> dict[str, Any]:
    """runs[0] is the AR baseline. Returns the report.json dict (schema in the docstring)."""
    if not runs or runs[0].scheme != "ar":
        raise ValueError("build_report: runs[0] must be the autoregressive baseline")
    greedy = settings.get("sampling", {}).get("temperature", 0.0) == 0.0
    entries = [run_summary(r, runs[0], greedy) for r in runs]
    for run, entry in zip(runs[2:], entries[2:]):  # every draft run against the first one
        entry["tau_vs_primary"] = tau_difference(run.outputs, runs[1].outputs)
    primary = entries[1] if len(entries) > 1 else entries[0]
    top = {k: v for k, v in primary.items() if k not in ("name", "draft", "errors")}
    return {"format_version": FORMAT_VERSION, **top, "primary": primary["name"],
            "settings": settings, "runs": entries}


def write_report(report: dict[str, Any], output_dir: str | Path,
                 runs: Sequence[RunResult] = ()) -> dict[str, Path]:
    """Write report.json, report.md, the PNGs and (given runs) outputs.jsonl; returns paths."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "md": out / "report.md"}
    # allow_nan=False: a NaN/inf would make the file unreadable to strict JSON parsers.
    paths["json"].write_text(json.dumps(_clean(report), indent=2, allow_nan=False) + "\n")
    paths["md"].write_text(render_markdown(report))
    for name, path in write_plots(report, out).items():
        paths[name] = path
    if runs:
        paths["outputs"] = out / "outputs.jsonl"
        with open(paths["outputs"], "w") as f:
            for r in runs:
                for o in r.outputs:
                    f.write(json.dumps({"run": r.name, "id": o.prompt_id, "category": o.category,
                                        "turn": o.turn, "finish_reason": o.finish_reason,
                                        "error": o.error, "num_tokens": len(o.token_ids),
                                        "target_steps": o.target_steps, "text": o.text}) + "\n")
    return paths


def _clean(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


# ---- markdown -------------------------------------------------------------------------
def _f(x: Any, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(_f(c) if not isinstance(c, str) else c for c in r) + " |"
              for r in rows), ""]


def format_interval(ci: list[float] | None) -> str:
    """tau_ci95 as text: "1.191-1.236", or "-"."""
    return "-" if not ci else f"{ci[0]:.3f}-{ci[1]:.3f}"


def format_difference(d: dict[str, Any] | None) -> str:
    """tau_vs_primary as text: "+0.033 (+0.021, +0.046)", or "-"."""
    return "-" if not d else f"{d['diff']:+.3f} ({d['ci'][0]:+.3f}, {d['ci'][1]:+.3f})"


def render_markdown(report: dict[str, Any]) -> str:
    runs, st = report["runs"], report["settings"]
    k = max(len(r["per_position_accept_rate"]) for r in runs)
    lines = ["# Speculative decoding report", "", "## Settings", ""]
    lines += _table(["setting", "value"],
                    [[key, f"`{json.dumps(value, default=str)}`"] for key, value in st.items()])
    lines += ["## By draft", ""]
    rows = []
    for r in runs:
        lc = r["lossless_check"]
        rows.append([r["name"], r["scheme"], r["mean_accept_len"], format_interval(r.get("tau_ci95")),
                     format_difference(r.get("tau_vs_primary")), r.get("tokens_per_target_pass"),
                     r["tokens_per_s"], r["speedup"], r.get("best_speedup"),
                     r.get("decode_speedup"),
                     "-" if lc is None else f"{lc['mismatched']}/{lc['compared']}",
                     r["generated_tokens"], r["target_steps"], r["num_errors"],
                     *(r["per_position_accept_rate"] + [None] * k)[:k]])
    lines += _table(["run", "scheme", "τ (rounds)", "τ 95% CI", f"τ - {report['primary']} (95% CI)",
                     "tokens/target pass", "tok/s", "speedup",
                     "best speedup", "decode speedup", "lossless mismatched/compared", "tokens",
                     "target steps", "errors", *(f"α_{i}" for i in range(1, k + 1))], rows)
    timed = [r for r in runs if r.get("time_split_s")]
    if timed:
        phases = list(dict.fromkeys(p for r in timed for p in r["time_split_s"]))
        lines += ["## Where the time goes (seconds, median pass)", ""]
        lines += _table(["run", "wall", *phases],
                        [[r["name"], r["wall_s"], *(r["time_split_s"].get(p) for p in phases)]
                         for r in timed])
    cats = sorted({c for r in runs for c in r["by_category"]})
    lines += ["## τ by category", ""]
    lines += _table(["category", "prompts", *(r["name"] for r in runs)],
                    [[c, max(r["by_category"].get(c, {}).get("num_prompts", 0) for r in runs),
                      *(r["by_category"].get(c, {}).get("mean_accept_len") for r in runs)]
                     for c in cats])
    lines += ["## Accept-length histogram (target steps accepting a drafts)", ""]
    lines += _table(["run", *(f"a={a}" for a in range(k + 1))],
                    [[r["name"], *(r["accept_len_hist"] + [0] * (k + 1))[:k + 1]] for r in runs])
    errors = [(r["name"], e) for r in runs for e in r["errors"]]
    if errors:
        lines += ["## Errors", ""]
        lines += _table(["run", "id", "turn", "error"],
                        [[n, str(e["id"]), e["turn"], str(e["error"]).replace("|", "/")[:200]]
                         for n, e in errors])
    lines += ["## Plots", "", *(f"![{p[:-4]}]({p})" for p in PLOTS), ""]
    return "\n".join(lines)


# ---- plots -----------------------------------------------------------------------------
def write_plots(report: dict[str, Any], out: Path) -> dict[str, Path]:
    """The four PNGs of PLOTS; drafts side by side (the baseline alone when none ran)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    runs = report["runs"]
    drafts = runs[1:] or runs[:1]
    paths = {}

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        paths[name[:-4]] = out / name

    width = 0.8 / len(drafts)
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, r in enumerate(drafts):
        steps = max(r["target_steps"], 1)
        xs = [a + i * width for a in range(len(r["accept_len_hist"]))]
        ax.bar(xs, [c / steps for c in r["accept_len_hist"]], width, label=r["name"])
    k1 = max(len(r["accept_len_hist"]) for r in drafts)
    ax.set_xticks([a + 0.4 - width / 2 for a in range(k1)], [str(a) for a in range(k1)])
    ax.set(xlabel="drafts accepted per target step", ylabel="fraction of steps",
           title="Accept-length histogram")
    ax.legend()
    save(fig, "accept_len_hist.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in drafts:
        alpha = r["per_position_accept_rate"]
        ax.plot(range(1, len(alpha) + 1), [float("nan") if a is None else a for a in alpha],
                marker="o", label=r["name"])
    ax.set(xlabel="draft position k", ylabel="α_k", ylim=(0, 1.05),
           title="Per-position acceptance (given 1..k-1 accepted)")
    ax.legend()
    save(fig, "per_position_accept.png")

    cats = sorted({c for r in runs for c in r["by_category"]})
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats)), 4))
    for i, r in enumerate(runs):
        taus = [r["by_category"].get(c, {}).get("mean_accept_len") or 0.0 for c in cats]
        ax.bar([j + i * width for j in range(len(cats))], taus, width, label=r["name"])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cats))], cats)
    ax.set(ylabel="τ (tokens per target step)", title="Mean accepted length by category")
    ax.legend()
    save(fig, "tau_by_category.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([r["name"] for r in runs], [r["speedup"] or 0.0 for r in runs])
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set(ylabel="speedup over AR (tokens/s)", title="Wall-clock speedup by draft")
    save(fig, "speedup.png")
    return paths
