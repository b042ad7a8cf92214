"""heads.frozen.load_frozen reads only the shards that hold the embedding, final norm and
lm_head: locally it opens only those files, from the hub it downloads only config.json, the
index and those files. The tensors and fingerprint equal the whole target's."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import heads.frozen as frozen
from inference_eval.engine.target import TargetConfig, load_target
from tiny_hf_models import make_tiny_hf

NEEDED = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """An untied tiny llama saved in ~40 KB shards: (dir, HF model, weight_map)."""
    d = tmp_path_factory.mktemp("sharded")
    model = make_tiny_hf("llama3", d / "whole")
    model.save_pretrained(d / "hf", max_shard_size="40KB")
    weight_map = json.loads((d / "hf" / frozen.INDEX).read_text())["weight_map"]
    return d / "hf", model, weight_map


@pytest.fixture
def opened(monkeypatch):
    """File names heads.frozen opens with safe_open."""
    names = []
    real = frozen.safe_open

    def spy(path, *a, **kw):
        names.append(Path(path).name)
        return real(path, *a, **kw)

    monkeypatch.setattr(frozen, "safe_open", spy)
    return names


def _check_parts(parts, model):
    sd = model.state_dict()
    torch.testing.assert_close(parts.embed, sd["model.embed_tokens.weight"], rtol=0, atol=0)
    torch.testing.assert_close(parts.norm_weight, sd["model.norm.weight"], rtol=0, atol=0)
    torch.testing.assert_close(parts.lm_head, sd["lm_head.weight"], rtol=0, atol=0)


def test_local_sharded_checkpoint_opens_only_the_needed_shards(sharded, opened):
    hf_dir, model, weight_map = sharded
    all_files = set(weight_map.values())
    needed = {weight_map[n] for n in NEEDED}
    assert len(all_files) > len(needed) + 3  # the test means something: most shards are others
    cfg = TargetConfig(name="tiny-llama", source="hf", path=str(hf_dir))
    parts = frozen.load_frozen(cfg)
    assert sorted(opened) == sorted(needed)
    _check_parts(parts, model)
    # The fingerprint a head records equals the one the engine computes from the whole target.
    whole = load_target(cfg, with_tokenizer=False)
    assert parts.identity["frozen_sha256"] == whole.identity["frozen_sha256"]


def test_hub_id_downloads_only_config_index_and_needed_shards(sharded, opened, monkeypatch,
                                                              tmp_path):
    from huggingface_hub.errors import EntryNotFoundError

    hf_dir, model, weight_map = sharded
    snapshot = tmp_path / "hub" / "snapshots" / "abc"
    asked = []

    def fake_download(repo_id, filename, **kw):  # the hub cache, filled file by file
        assert repo_id == "org/tiny-llama"
        asked.append(filename)
        src = hf_dir / filename
        if not src.is_file():
            raise EntryNotFoundError(f"{filename} not in {repo_id}")
        snapshot.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, snapshot / filename)
        return str(snapshot / filename)

    monkeypatch.setattr("huggingface_hub.hf_hub_download", fake_download)
    parts = frozen.load_frozen(TargetConfig(name="tiny-llama", source="hf", path="org/tiny-llama"))
    needed = sorted({weight_map[n] for n in NEEDED})
    assert sorted(asked) == sorted(["config.json", frozen.INDEX, *needed])
    assert sorted(p.name for p in snapshot.glob("*.safetensors")) == needed
    assert sorted(opened) == needed
    _check_parts(parts, model)


def test_hub_id_of_an_unsharded_checkpoint_downloads_its_one_file(tmp_path, monkeypatch):
    from huggingface_hub.errors import EntryNotFoundError

    model = make_tiny_hf("smollm2", tmp_path / "hf")  # tied: lm_head is the embedding
    asked = []

    def fake_download(repo_id, filename, **kw):
        asked.append(filename)
        if not (tmp_path / "hf" / filename).is_file():
            raise EntryNotFoundError(filename)
        return str(tmp_path / "hf" / filename)

    monkeypatch.setattr("huggingface_hub.hf_hub_download", fake_download)
    parts = frozen.load_frozen(TargetConfig(name="s", source="hf", path="org/small"))
    assert asked == ["config.json", frozen.INDEX, "model.safetensors"]
    torch.testing.assert_close(parts.lm_head, model.state_dict()["model.embed_tokens.weight"])
    assert parts.lm_head.data_ptr() == parts.embed.data_ptr()


def test_target_identity_does_not_depend_on_the_serving_dtype(sharded):
    """A head trained on the fp32 target is that target's head when the engine serves it in
    bf16: the fingerprints describe the weights as loaded, and differ for other weights."""
    hf_dir, _, _ = sharded
    ids = {dt: load_target(TargetConfig(name="t", source="hf", path=str(hf_dir), dtype=dt),
                           with_tokenizer=False) for dt in ("float32", "bfloat16")}
    assert ids["bfloat16"].model.lm_head_weight.dtype == torch.bfloat16
    a, b = ids["float32"].identity, ids["bfloat16"].identity
    assert a["frozen_sha256"] == b["frozen_sha256"] and a["weights_sha256"] == b["weights_sha256"]
    other = load_target(TargetConfig(name="t", source="random", arch=a["arch"], seed=1),
                        with_tokenizer=False).identity
    assert other["frozen_sha256"] != a["frozen_sha256"]
