"""Bad tensor-parallel input gets one clear line, and nothing hangs: a size that does not
divide the heads (and cannot replicate the KV heads), a world that is not a multiple of it,
TP > 1 without torchrun, and a rank that dies mid-run (the process-group timeout bounds the
wait)."""
from __future__ import annotations

import pytest

from tiny_hf_models import make_tiny_hf
from tp_ranks import run_ranks
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.model.arch import ModelArch
from inference_eval.engine.parallel.group import check_world
from inference_eval.engine.parallel.runner import tensor_parallel_engine
from inference_eval.engine.parallel.shard import ShardPlan
from inference_eval.engine.target import TargetConfig

ENV = dict(RANK="0", WORLD_SIZE="6", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")


@pytest.mark.parametrize("heads,kv,size,message", [
    (6, 2, 4, "engine.tensor_parallel=4 does not divide the target's num_heads=6"),
    (6, 3, 2, "engine.tensor_parallel=2 and the target's num_kv_heads=3: one must divide"),
    (12, 6, 4, "engine.tensor_parallel=4 and the target's num_kv_heads=6: one must divide"),
])
def test_unsplittable_heads_are_refused_by_name(heads, kv, size, message):
    with pytest.raises(ValueError, match=message):
        ShardPlan(ModelArch(num_heads=heads, num_kv_heads=kv, head_dim=8, hidden_size=48,
                            intermediate_size=96), size, 0)


def test_replicated_kv_heads_map_to_their_query_heads():
    # 8 query heads over 2 KV heads at 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 KV head 1.
    arch = ModelArch(num_heads=8, num_kv_heads=2, head_dim=4, hidden_size=32)
    assert [ShardPlan(arch, 4, r).kv_start for r in range(4)] == [0, 0, 1, 1]
    assert [ShardPlan(arch, 4, r).head_start for r in range(4)] == [0, 2, 4, 6]


def test_world_not_a_multiple_of_tp():
    with pytest.raises(ValueError, match="engine.tensor_parallel=4 does not divide the world "
                                         "size 6"):
        check_world(4, ENV)


def test_tp_without_torchrun(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"engine.tensor_parallel=2 needs one process per "
                                           r"rank from torchrun .*torchrun --nproc_per_node 2"):
        with tensor_parallel_engine(TargetConfig(), EngineConfig(tensor_parallel=2)):
            pass


def test_engine_config_validates_tp_keys():
    with pytest.raises(ValueError, match="engine.tensor_parallel must be >= 1"):
        EngineConfig(tensor_parallel=0)
    with pytest.raises(ValueError, match="engine.compile=true is single-device"):
        EngineConfig(tensor_parallel=2, compile=True)
    with pytest.raises(ValueError, match="engine.tp_timeout_s must be > 0"):
        EngineConfig(tp_timeout_s=0)


def test_every_rank_refuses_an_unsplittable_target(tmp_path):
    hf_dir = tmp_path / "three_heads"
    make_tiny_hf("llama3", hf_dir, num_attention_heads=3, num_key_value_heads=3)
    results = run_ranks("error_worker", 2, str(hf_dir), 2, tmp=tmp_path, timeout=60)
    for res in results:  # every rank stopped by itself, with the same line
        assert res.get("error", "").startswith(
            "ValueError: engine.tensor_parallel=2 does not divide the target's num_heads=3"), res


def test_a_dead_rank_stops_the_leader_with_an_error(tmp_path):
    hf_dir = tmp_path / "tiny"
    make_tiny_hf("llama3", hf_dir)
    results = run_ranks("dying_worker", 2, str(hf_dir), 10.0, tmp=tmp_path, timeout=90)
    assert results[1] == {"exitcode": 3}
    leader = results[0]["ok"]
    assert leader["error"], leader
    assert leader["seconds"] < 30, leader  # the gloo timeout (10 s) bounds it, if not sooner
