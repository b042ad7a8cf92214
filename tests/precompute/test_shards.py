"""Shard files, the plan and the manifest, without a model: layout, integrity, fp8, sizes."""
from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from precompute.config import PrecomputeConfig
from precompute.manifest import FORMAT_VERSION, Manifest, ShardEntry
from precompute.plan import plan_batches, plan_hash, plan_shards
from precompute.shard_io import (
    Shard,
    ShardIntegrityError,
    bytes_per_token,
    file_sha256,
    quantize_fp8,
    read_shard,
    write_shard,
)


def make_shard(lengths=(5, 3, 8), h=16, aux=0, dtype=torch.bfloat16, seed=0) -> Shard:
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return Shard(input_ids=torch.randint(0, 320, (n,), generator=g, dtype=torch.int32),
                 loss_mask=(torch.rand(n, generator=g) > 0.5).to(torch.uint8),
                 hidden=torch.randn(n, h, generator=g).to(dtype), cu_seqlens=cu,
                 aux_hidden=torch.randn(n, aux, h, generator=g).to(dtype) if aux else None,
                 record_ids=[f"r{i}" for i in range(len(lengths))])


def test_write_read_round_trip_keeps_every_tensor(tmp_path):
    s = make_shard(aux=2)
    path = tmp_path / "shard_00000.safetensors"
    digest = write_shard(path, s)
    assert digest == file_sha256(path)
    got = read_shard(path, digest)
    for key in ("input_ids", "loss_mask", "hidden", "cu_seqlens", "aux_hidden"):
        assert torch.equal(getattr(got, key), getattr(s, key)), key
        assert getattr(got, key).dtype == getattr(s, key).dtype, key
    assert got.record_ids == ["r0", "r1", "r2"] and got.num_sequences == 3
    assert got.hidden_scale is None
    assert not list(tmp_path.glob(".*")), "the temp file is renamed away"
    # safetensors creates 0600 files; shards follow the umask so other users can train on them
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_flipped_byte_is_reported_with_the_shard_file_name(tmp_path):
    path = tmp_path / "shard_00007.safetensors"
    digest = write_shard(path, make_shard())
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0x01  # inside the tensor data: the header still parses
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardIntegrityError, match="shard_00007.safetensors"):
        read_shard(path, digest)
    read_shard(path)  # without a digest nothing can tell; the tensors still load


def test_missing_or_garbled_shard_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="shard_00003.safetensors"):
        read_shard(tmp_path / "shard_00003.safetensors", "0" * 64)
    path = tmp_path / "shard_00004.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ShardIntegrityError, match="shard_00004.safetensors"):
        read_shard(path)


def test_inconsistent_shapes_are_refused_naming_the_file(tmp_path):
    s = make_shard()
    s.cu_seqlens = torch.tensor([0, 5, 99])
    path = tmp_path / "shard_00001.safetensors"
    write_shard(path, s)
    with pytest.raises(ShardIntegrityError, match="shard_00001.safetensors.*cu_seqlens"):
        read_shard(path)


def test_fp8_round_trips_within_e4m3_tolerance(tmp_path):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(40, 64, generator=g) * torch.logspace(-3, 2, 40).unsqueeze(1)  # wide row scales
    q, scale = quantize_fp8(h)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (40,)
    path = tmp_path / "shard_00000.safetensors"
    digest = write_shard(path, Shard(input_ids=torch.zeros(40, dtype=torch.int32),
                                     loss_mask=torch.ones(40, dtype=torch.uint8), hidden=q,
                                     cu_seqlens=torch.tensor([0, 40]), hidden_scale=scale))
    back = read_shard(path, digest).hidden_float()
    assert back.dtype == torch.float32 and back.shape == h.shape
    # e4m3: 3 mantissa bits (relative step 2^-3, so rounding error <= 2^-4), and subnormals
    # below 2^-6 of the row's scale step by 2^-9 of it.
    row_max = h.abs().amax(dim=1, keepdim=True)
    bound = 2.0 ** -4 * h.abs() + row_max / 448 * 2.0 ** -10 + 1e-12
    assert bool(((back - h).abs() <= bound).all())
    rel = ((back - h).norm(dim=1) / h.norm(dim=1)).max()
    assert rel < 0.05


def test_bytes_per_token_matches_the_written_file(tmp_path):
    h, n = 64, 600
    for dtype, aux in (("bfloat16", 0), ("bfloat16", 3), ("float32", 0), ("fp8", 2)):
        s = make_shard(lengths=(n,), h=h, aux=aux, dtype=torch.float32)
        if dtype == "fp8":
            s.hidden, s.hidden_scale = quantize_fp8(s.hidden)
            s.aux_hidden = s.aux_hidden.to(torch.bfloat16)
        else:
            s.hidden = s.hidden.to(getattr(torch, dtype))
            s.aux_hidden = None if s.aux_hidden is None else s.aux_hidden.to(getattr(torch, dtype))
        path = tmp_path / f"{dtype}{aux}.safetensors"
        write_shard(path, s)
        header = path.stat().st_size - n * bytes_per_token(h, aux, dtype)
        assert 0 < header < 1024, (dtype, aux, header)
    assert bytes_per_token(h, 0, "bfloat16") == 2 * h + 5  # the last-hidden-only default


def test_plan_shards_fill_in_order_and_batches_respect_the_token_budget():
    lengths = [300, 50, 700, 20, 1200, 90, 90, 400]
    shards = plan_shards(lengths, 1000)
    assert [i for s in shards for i in s] == list(range(len(lengths)))  # dataset order
    for s in shards:
        assert sum(lengths[i] for i in s) <= 1000 or len(s) == 1  # a long record stands alone
    batches = plan_batches(range(len(lengths)), lengths, 512)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        widths = [lengths[i] for i in b]
        assert widths == sorted(widths, reverse=True)
        assert len(b) * widths[0] <= 512 or len(b) == 1
    assert plan_batches(range(3), [5, 5, 5], 15) == [[0, 1, 2]]
    assert plan_hash({"a": 1, "b": [2]}) == plan_hash({"b": [2], "a": 1})
    assert plan_hash({"a": 1}) != plan_hash({"a": 2})


def test_manifest_round_trip_and_version_check(tmp_path):
    m = Manifest(target={"name": "t"}, tokenizer={}, hidden_dtype="bfloat16", hidden_size=8,
                 aux_layers=[], plan_hash="x", num_planned_shards=2,
                 shards=[ShardEntry("shard_00001.safetensors", "b", 1, 7, 3, 1),
                         ShardEntry("shard_00000.safetensors", "a", 2, 5, 2, 0)])
    m.save(tmp_path / "manifest.json")
    d = json.loads((tmp_path / "manifest.json").read_text())
    assert [s["index"] for s in d["shards"]] == [0, 1]
    assert d["hidden_convention"] == "last_layer_pre_final_norm"
    back = Manifest.load(tmp_path / "manifest.json")
    assert back.num_tokens == 12 and back.done_indices() == {0, 1}
    d["format_version"] = FORMAT_VERSION + 1
    (tmp_path / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="format_version"):
        Manifest.load(tmp_path / "manifest.json")


@pytest.mark.parametrize("layers, want", [(32, [1, 15, 28]), (30, [1, 14, 26]), (3, [0, 1]),
                                          (2, [0, 1])])
def test_eagle3_aux_layers_stay_in_range(layers, want):
    assert PrecomputeConfig(aux="eagle3").aux_layer_ids(layers) == want
    assert PrecomputeConfig(aux="0,2").aux_layer_ids(3) == [0, 2]
    with pytest.raises(ValueError, match="outside"):
        PrecomputeConfig(aux="5").aux_layer_ids(3)


@pytest.mark.parametrize("bad, key", [({"hidden_dtype": "int8"}, "hidden_dtype"),
                                      ({"shard_tokens": 0}, "shard_tokens"),
                                      ({"aux": "first"}, "aux")])
def test_config_errors_name_the_key(bad, key):
    with pytest.raises(ValueError, match=key):
        PrecomputeConfig(**bad)
