"""A rank of a 2-way split holds about half the weights and reads only its slices of every
split tensor (the safetensors reader is wrapped and every read recorded)."""
from __future__ import annotations

from tiny_hf_models import make_tiny_hf
from tp_ranks import leader_result, run_ranks
from inference_eval.engine.parallel.tp import local_parameter_bytes
from inference_eval.engine.target import TargetConfig, load_target

REPLICATED = ("norm.weight",)  # input/post-attention/final norms: read whole on every rank


def test_rank_holds_half_and_reads_only_its_slices(tmp_path):
    # A large vocabulary, so the embedding and lm_head dominate, as in real targets.
    hf_dir = tmp_path / "big_vocab"
    make_tiny_hf("llama3", hf_dir, vocab_size=16384, hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    full = load_target(TargetConfig(source="hf", path=str(hf_dir)), with_tokenizer=False)
    total = local_parameter_bytes(full.model)
    results = run_ranks("memory_worker", 2, str(hf_dir), tmp=tmp_path, timeout=120)
    leader_result(results)
    from safetensors import safe_open

    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        numel = {n: f.get_slice(n).get_shape() for n in f.keys()}
    for rank, res in enumerate(r["ok"] for r in results):
        assert res["param_bytes"] <= 0.55 * total, (rank, res["param_bytes"], total)
        assert res["identity"]["weights_sha256"] == full.identity["weights_sha256"]
        reads = res["reads"]
        assert all(n.endswith(REPLICATED) for n in reads["full"]), sorted(reads["full"])
        for name, counts in reads["slices"].items():
            shape = numel[name]
            whole = shape[0] * (shape[1] if len(shape) > 1 else 1)
            assert sum(counts) <= whole // 2, (rank, name, counts, whole)
        split = {n for n in numel if not n.endswith(REPLICATED)}
        assert set(reads["slices"]) == split  # every split tensor read, by slices only
