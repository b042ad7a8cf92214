"""scripts/check_vllm.py: τ and α_k from vLLM-style counters, the same numbers from our
per-round steps, the output comparison and the table. No vLLM needed."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "check_vllm.py"
_spec = importlib.util.spec_from_file_location("check_vllm", _PATH)
cv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cv)


def test_steps_give_the_metrics_docstring_example():
    # metrics.py's worked example, K=3: prefill (0,0), then (3,2), (3,0), (3,3).
    c = cv.counters_from_steps([0, 3, 3, 3], [0, 2, 0, 3], k=3)
    assert c == {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 5,
                 "accepted_per_pos": [2, 2, 1], "attempted_per_pos": [3, 2, 2]}
    r = cv.rates_from_counters(c, 3)
    assert r["tau"] == pytest.approx(8 / 3)  # = metrics.mean_accept_len of the same output
    assert r["alpha"] == pytest.approx([2 / 3, 1.0, 0.5])
    assert r["exact"]


def test_vllm_counters_imply_the_same_rates():
    # What vLLM's V1 metrics report for the same three rounds (no attempted_per_pos).
    metrics = [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=3),
               SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=9),
               SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=5),
               SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos",
                               values=[2, 2, 1]),
               SimpleNamespace(name="vllm:num_requests_running", value=0)]
    c = cv.read_spec_metrics(metrics)
    r = cv.rates_from_counters(c, 3)
    assert r["tau"] == pytest.approx(8 / 3)
    assert r["alpha"] == pytest.approx([2 / 3, 1.0, 0.5])
    assert r["exact"]


def test_short_rounds_mark_vllm_alpha_inexact_and_empty_counters_give_none():
    c = {"num_drafts": 2, "num_draft_tokens": 5, "num_accepted_tokens": 1,
         "accepted_per_pos": [1]}
    r = cv.rates_from_counters(c, 3)
    assert not r["exact"] and r["alpha"] == [0.5, 0.0, None]
    empty = cv.rates_from_counters({"num_drafts": 0, "num_draft_tokens": 0,
                                    "num_accepted_tokens": 0, "accepted_per_pos": []}, 2)
    assert empty["tau"] is None and empty["alpha"] == [None, None]


def test_compare_outputs_and_table():
    assert cv.compare_outputs([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 9], [6, 7]]) == [
        {"index": 1, "at": 1}, {"index": 2, "at": 1}]
    text = cv.table(2, {"specheads": {"tau": 1.5, "alpha": [0.4, None], "num_drafts": 10,
                                      "counters": {"num_accepted_tokens": 5}},
                        "vllm": {"tau": 1.25, "alpha": [0.25, 0.0], "num_drafts": 12}})
    lines = text.splitlines()
    assert lines[0].split() == ["specheads", "vllm"]
    assert lines[1].split() == ["tau", "1.500", "1.250"]
    assert lines[2].split() == ["rounds", "10", "12"]
    assert lines[3].split() == ["accepted", "5", "-"]
    assert lines[5].split() == ["alpha_2", "-", "0.000"]
