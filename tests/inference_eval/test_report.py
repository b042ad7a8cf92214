"""report.json is self-consistent, report.md carries the settings, the PNGs are written."""
from __future__ import annotations

import json
import random

import pytest

from inference_eval.evaluation.metrics import TurnOutput
from inference_eval.evaluation.report import PLOTS, RunResult, build_report, write_report

# The keys every run of report.json carries (the table in docs/evaluation.md, Reports).
REQUIRED = ("scheme", "num_prompts", "generated_tokens", "target_steps", "mean_accept_len",
            "accept_len_hist", "per_position_accept_rate", "tokens_per_s", "ar_tokens_per_s",
            "speedup", "lossless_check", "by_category")


def _outputs(seed: int, k: int, cats=("code", "chat")) -> list[TurnOutput]:
    """AR outputs when k = 0, else random chains of up to k drafts; same token ids per seed
    so greedy draft runs are lossless against the baseline."""
    rng, tok_rng = random.Random(seed), random.Random(0)
    outs = []
    for i in range(6):
        n = 10 + i
        tokens = [tok_rng.randrange(100) for _ in range(n)]
        p, a, left = [0], [0], n - 1
        while left > 0:
            take = min(left, 1 + (rng.randint(0, k) if k else 0))
            p.append(k)
            a.append(take - 1)
            left -= take
        outs.append(TurnOutput(f"q{i}", cats[i % len(cats)], i % 2, tokens, p, a, "length",
                               prefill_steps=1))
    return outs


def _runs(drafts=(("mtp-chain", 3, 2.0), ("eagle-tree", 4, 1.0))):
    base = RunResult("ar", "ar", {"kind": "none"}, _outputs(0, 0), wall_s=4.0)
    return [base] + [RunResult(name, "chain", {"kind": "head"}, _outputs(7 + k, k), wall_s=w)
                     for name, k, w in drafts]


SETTINGS = {"target": {"name": "tiny"}, "sampling": {"temperature": 0.0, "max_new_tokens": 16},
            "batch_size": 4, "max_new_tokens": 16, "prompts": {"name": "jsonl"}}


def _check_consistent(entry):
    pre = entry["prefill_steps"]
    tau = (entry["generated_tokens"] - pre) / (entry["target_steps"] - pre)
    assert entry["mean_accept_len"] == pytest.approx(tau)
    assert entry["tokens_per_target_pass"] == pytest.approx(
        entry["generated_tokens"] / entry["target_steps"])
    assert sum(entry["accept_len_hist"]) == entry["target_steps"]
    assert len(entry["accept_len_hist"]) == len(entry["per_position_accept_rate"]) + 1


def test_report_json_is_consistent_and_side_by_side(tmp_path):
    runs = _runs()
    paths = write_report(build_report(runs, SETTINGS), tmp_path, runs)
    report = json.loads(paths["json"].read_text())
    assert [r["name"] for r in report["runs"]] == ["ar", "mtp-chain", "eagle-tree"]
    assert report["primary"] == "mtp-chain" and report["settings"] == SETTINGS
    for key in REQUIRED:
        assert key in report and report[key] == report["runs"][1][key], key
    ar = report["runs"][0]
    assert ar["mean_accept_len"] == 1.0 and ar["speedup"] == 1.0 and ar["scheme"] == "ar"
    # τ's bootstrap interval on every run, the paired difference from the primary after it
    assert ar["tau_ci95"] == [1.0, 1.0] and "tau_vs_primary" not in report["runs"][1]
    second, first = report["runs"][2], report["runs"][1]
    lo, hi = second["tau_ci95"]
    assert lo <= second["mean_accept_len"] <= hi
    vs = second["tau_vs_primary"]
    assert vs["diff"] == pytest.approx(second["mean_accept_len"] - first["mean_accept_len"])
    assert vs["ci"][0] <= vs["diff"] <= vs["ci"][1] and vs["prompts"] == 6
    md = paths["md"].read_text()
    assert "τ - mtp-chain (95% CI)" in md and f"{vs['diff']:+.3f}" in md
    for entry in report["runs"]:
        _check_consistent(entry)
        cats = entry["by_category"]
        assert sum(c["target_steps"] for c in cats.values()) == entry["target_steps"]
        assert sum(c["generated_tokens"] for c in cats.values()) == entry["generated_tokens"]
        for c in cats.values():
            _check_consistent(c)
        assert entry["tokens_per_s"] == pytest.approx(entry["generated_tokens"] / entry["wall_s"])
        assert entry["ar_tokens_per_s"] == pytest.approx(ar["tokens_per_s"])
        assert entry["speedup"] == pytest.approx(entry["tokens_per_s"] / ar["tokens_per_s"])
        counts = entry["position_counts"]
        alpha = entry["per_position_accept_rate"]
        for a, n, t in zip(alpha, counts["attempted"], counts["accepted"]):
            assert a == pytest.approx(t / n)
    assert report["runs"][1]["lossless_check"] == {"compared": 6, "mismatched": 0, "mismatches": []}
    assert report["runs"][1]["speedup"] == pytest.approx(2.0)
    _check_consistent(report)
    for name in PLOTS:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    md = paths["md"].read_text()
    for needle in ("| mtp-chain | chain |", "| eagle-tree |", "## τ by category", "| code |",
                   '"max_new_tokens": 16', "batch_size", "![speedup](speedup.png)"):
        assert needle in md, needle
    lines = paths["outputs"].read_text().splitlines()
    assert len(lines) == 18 and json.loads(lines[0])["run"] == "ar"


def test_baseline_only_errors_and_sampled(tmp_path):
    runs = _runs(drafts=())
    runs[0].outputs[2] = TurnOutput("q2", "code", 0, error="prompt 2: too long")
    report = build_report(runs, {**SETTINGS, "sampling": {"temperature": 0.7}})
    assert report["primary"] == "ar" and report["speedup"] == 1.0
    assert report["lossless_check"] is None  # only greedy runs have a lossless check
    assert report["runs"][0]["errors"] == [{"id": "q2", "turn": 0, "error": "prompt 2: too long"}]
    _check_consistent(report)
    paths = write_report(report, tmp_path / "out")
    assert all((tmp_path / "out" / p).is_file() for p in PLOTS)
    assert "## Errors" in paths["md"].read_text()
    greedy = build_report(runs, SETTINGS)
    assert greedy["lossless_check"] == {"compared": 0, "mismatched": 0, "mismatches": []}


def test_lossless_mismatch_and_bad_runs():
    runs = _runs(drafts=(("d", 2, 1.0),))
    runs[1].outputs[0].token_ids[3] += 1
    report = build_report(runs, SETTINGS)
    assert report["lossless_check"]["mismatched"] == 1
    assert report["lossless_check"]["mismatches"] == [{"id": "q0", "turn": 0, "at": 3}]
    with pytest.raises(ValueError, match="baseline"):
        build_report(runs[1:], SETTINGS)


def test_the_printed_summary_carries_the_intervals(capsys):
    from inference_eval.evaluation.evaluate import print_summary

    report = build_report(_runs(), SETTINGS)
    print_summary(report)
    out = capsys.readouterr().out.splitlines()
    first, second = report["runs"][1], report["runs"][2]
    lo, hi = first["tau_ci95"]
    assert out[1].startswith(f"[mtp-chain] τ={first['mean_accept_len']:.3f} (95% {lo:.3f}-{hi:.3f})")
    vs = second["tau_vs_primary"]
    assert f"; vs mtp-chain {vs['diff']:+.3f} ({vs['ci'][0]:+.3f}, {vs['ci'][1]:+.3f}))" in out[2]
    assert out[0].startswith("[ar] τ=1.000  α=")
