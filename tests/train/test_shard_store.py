"""`data.shards` with several precompute dirs: one store over all their sequences, refused
when the dirs do not come from one target."""
from __future__ import annotations

import json

import pytest

from train.data import ShardStore


def test_two_dirs_give_one_store_of_both(shards, make_shards, tmp_path):
    other = make_shards(tmp_path / "b", num_shards=1, seqs=7, seed=3)
    one, both = ShardStore(shards), ShardStore(f"{shards}, {other}")
    assert len(both.seqs) == len(one.seqs) + 7 and len(both.shards) == len(one.shards) + 1
    last = both.seqs[-1]  # the second dir's sequences point at its own shard
    assert last.shard == len(both.shards) - 1
    batch = both.collate([len(both.seqs) - 1])
    assert batch.input_ids.numel() == last.end - last.start


def test_dirs_of_other_target_weights_are_refused(shards, make_shards, tmp_path):
    other = make_shards(tmp_path / "c", num_shards=1, seqs=3)
    man = json.loads((other / "manifest.json").read_text())
    man["target"]["weights_sha256"] = "0" * 64
    (other / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ValueError, match=f"{other}.*other target weights"):
        ShardStore(f"{shards},{other}")


def test_empty_list_is_refused():
    with pytest.raises(ValueError, match="names no shard directory"):
        ShardStore(" , ")
