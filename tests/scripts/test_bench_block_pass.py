"""scripts/bench_block_pass.py on the tiny target with random heads: every verb it times runs
(a chain step, the refills, DFlash's context write and block pass, P-EAGLE's mask pass, the
target's AR step and verifications), the round sums are the parts it names, and each
drafter's draft.round_costs are its round's parts over the AR step."""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from heads.checkpoint import save_head
from heads.config import HeadConfig
from heads.registry import build_head
from inference_eval.engine.target import load_target
from inference_eval.evaluation.config import EvalConfig
from inference_eval.evaluation.engines import frozen_parts_of
from inference_eval.hydra_app import compose

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench_block_pass.py"
_spec = importlib.util.spec_from_file_location("bench_block_pass", _PATH)
bb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bb)


def test_block_pass_bench_times_every_verb(tmp_path):
    loaded = load_target(compose("eval", EvalConfig, ["target=tiny"]).target, with_tokenizer=False)
    parts, aux = frozen_parts_of(loaded), [0, 1]
    heads = {"chain": dict(type="eagle3", num_steps=3), "peagle": dict(
        type="eagle3", num_steps=3, parallel_drafting=True), "dflash4": dict(
        type="dflash", num_steps=3), "dflash6": dict(type="dflash", num_steps=5)}
    for name, kw in heads.items():
        save_head(build_head(HeadConfig(**kw, aux_layers=aux), parts, seed=0), tmp_path / name)
    args = argparse.Namespace(target="tiny", chain=str(tmp_path / "chain"),
                              peagle=str(tmp_path / "peagle"), k=3, context=20, accepted=1,
                              dflash=[str(tmp_path / "dflash4"), str(tmp_path / "dflash6")],
                              reps=2, engine=["engine.page_size=4"])
    res = bb.measure(args)
    med = res["median_ms"]
    assert set(med) == {"chain_step", "chain_refill", "peagle_pass", "peagle_refill",
                        "dflash4_pass", "dflash4_context", "dflash6_pass", "dflash6_context",
                        "ar_step", "verify_2", "verify_3", "verify_4"}
    assert all(v > 0 for v in med.values())
    assert res["ratio_to_chain_step"]["chain_step"] == 1.0
    rounds = res["round_ms"]
    assert rounds["chain"] == pytest.approx(med["chain_refill"] + 2 * med["chain_step"], abs=2e-3)
    assert rounds["dflash6"] == pytest.approx(med["dflash6_context"] + med["dflash6_pass"], abs=2e-3)
    assert rounds["peagle"] == pytest.approx(med["peagle_refill"] + med["peagle_pass"], abs=2e-3)
    costs, ar = res["round_costs"], med["ar_step"]
    assert set(costs) == {"chain", "peagle", "dflash4", "dflash6"}
    assert all(len(c) == 4 for c in costs.values())  # rounds of 0..K drafts (DFlash: <= B-1)
    verify = [ar, med["verify_2"], med["verify_3"], med["verify_4"]]
    want = {"chain": [med["chain_refill"] + min(s, 2) * med["chain_step"] + verify[s] for s in range(4)],
            "peagle": [med["peagle_refill"] + (s > 0) * med["peagle_pass"] + verify[s] for s in range(4)],
            "dflash6": [med["dflash6_context"] + med["dflash6_pass"] + verify[s] for s in range(4)]}
    for name, c in want.items():
        assert costs[name] == pytest.approx([x / ar for x in c], abs=0.05), name
