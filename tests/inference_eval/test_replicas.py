"""Data parallelism over tensor-parallel replicas: the prompt split and its inverse, and the
eval's merge of the replicas' runs (parallel/replicas.py, report.merge_replicas)."""
from __future__ import annotations

import pytest
import torch

from inference_eval.engine.parallel.group import TPGroup
from inference_eval.engine.parallel.replicas import share, unshare
from inference_eval.evaluation.metrics import TurnOutput
from inference_eval.evaluation.report import RunResult, merge_replicas


def _tp(replica: int, replicas: int) -> TPGroup:
    return TPGroup(0, 2, None, 2 * replica, replica, replicas, torch.device("cpu"))


@pytest.mark.parametrize("n,replicas", [(3, 1), (7, 2), (8, 4), (5, 3)])
def test_share_covers_every_item_once_and_unshare_restores_the_order(n, replicas):
    items = [f"p{i}" for i in range(n)]
    parts = [share(items, _tp(r, replicas), "prompts") for r in range(replicas)]
    assert sorted(x for p in parts for x in p) == sorted(items)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert unshare(parts) == items


def test_share_with_fewer_items_than_replicas_names_the_fix():
    with pytest.raises(ValueError, match="1 prompts for 2 tensor-parallel replicas.*at least 2"):
        share(["only"], _tp(1, 2), "prompts")


def _run(outs: list[tuple[str, int, int]], wall: float, passes: list[float], rounds: int,
         split: dict) -> RunResult:
    outputs = [TurnOutput(pid, "c", turn, token_ids=[tok]) for pid, turn, tok in outs]
    return RunResult("c2", "chain", {}, outputs, wall, split, passes, {"rounds": rounds})


def test_merge_replicas_orders_outputs_and_takes_the_slowest_replicas_time():
    order = ["a", "b", "c"]
    r0 = _run([("a", 0, 1), ("c", 0, 3), ("a", 1, 4)], 2.0, [2.0, 5.0], 3, {"draft": 1.0})
    r1 = _run([("b", 0, 2), ("b", 1, 5)], 4.0, [4.0, 1.0], 2, {"draft": 3.0})
    (m,) = merge_replicas([[r0], [r1]], order)
    assert [(o.prompt_id, o.turn) for o in m.outputs] == [("a", 0), ("b", 0), ("c", 0),
                                                           ("a", 1), ("b", 1)]
    assert m.wall_s == 4.0 and m.time_split_s == {"draft": 3.0}
    assert m.wall_s_passes == [4.0, 5.0]
    assert m.counters == {"rounds": 5}
