"""scripts/bench_precompute.py's time split: its timers wrap the engine's product and causal
attention calls with their real signatures (a stale wrapper once broke `--split` on the
block-coded products' extra argument), count every product's FLOPs, and leave the dump's
output unchanged."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from inference_eval.engine.model.linear import set_cpu_blas
from inference_eval.engine.target import TargetConfig, load_target
from precompute.data import TokenizedRecord

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench_precompute.py"
_spec = importlib.util.spec_from_file_location("bench_precompute", _PATH)
bp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bp)


def test_split_times_products_and_attention_of_the_same_dump(tiny_hf):
    hf_dir, _ = tiny_hf("smollm2")
    model = load_target(TargetConfig(name="tiny_hf", source="hf", path=str(hf_dir)),
                        with_tokenizer=False).model
    set_cpu_blas(model, True, codes=False)  # as the bench's main does on CPU fp32
    g = torch.Generator().manual_seed(0)
    records = [TokenizedRecord(id=f"r{i}", loss_mask=[1] * n,
                               input_ids=torch.randint(3, 320, (n,), generator=g).tolist())
               for i, n in enumerate([40, 17, 9])]
    _, plain = bp.ours(model, records, 64)
    calls = []
    orig = bp.ours

    def ours(m, recs, bt):  # the split's own dump: its output must be the plain one's
        secs, shard = orig(m, recs, bt)
        calls.append(shard)
        return secs, shard

    bp.ours = ours
    try:
        split = bp.time_split(model, records, 64)
    finally:
        bp.ours = orig
    assert split["gemm_s"] > 0 and split["attention_s"] > 0
    assert split["gemm_s"] + split["attention_s"] <= split["total_s"] + 1e-3
    # FLOPs: every token through every decoder Linear (lm_head skipped) at 2 per weight.
    per_token = sum(2 * m.weight.numel() for m in model.layers.modules()
                    if isinstance(m, torch.nn.Linear))
    tokens = sum(len(r.input_ids) for r in records)
    assert split["gemm_flops"] == per_token * tokens
    torch.testing.assert_close(calls[0].hidden.float(), plain.hidden.float())
