"""scripts/bench_spec.py --host-time: its clock charges every model pass of a round to the
phase that ran it, so wall = model + host per step and the phases add up to the host time;
it counts decode steps only (prefills left out) and leaves the engines' outputs lossless."""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench_spec.py"
_spec = importlib.util.spec_from_file_location("bench_spec", _PATH)
bs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bs)


def test_host_time_splits_each_round_into_model_and_host():
    args = argparse.Namespace(engine=["engine.page_size=4"], seed=0, new=6, host_batch=2,
                              host_reps=1)
    res = bs.host_costs(args)
    for b in (1, 2):
        cell = res[f"bs{b}"]
        assert set(cell) == {"ar", "chain2", "chain4"}
        for name, c in cell.items():
            # one request per slot, 6 new tokens: 5 decode steps (a round emits >= 1 token)
            assert 1 <= c["steps"] <= 5, (name, c)
            assert c["tokens"] == b * 5
            assert c["model_ms"] > 0 and c["host_ms"] > 0
            assert c["wall_ms"] == pytest.approx(c["model_ms"] + c["host_ms"], abs=2e-3)
            if name != "ar":
                split = c["host_ms_by_phase"]
                assert set(split) == {"schedule", "draft", "verify", "catch_up"}
                assert sum(split.values()) == pytest.approx(c["host_ms"], rel=0.05, abs=5e-3)
                assert c["mismatched"] == 0  # greedy rounds emit the AR tokens
                assert c["host_ratio_to_ar"] == pytest.approx(c["host_ms"] / cell["ar"]["host_ms"],
                                                              rel=1e-2)
        assert cell["ar"]["steps"] == 5  # an AR step emits exactly one token a request
