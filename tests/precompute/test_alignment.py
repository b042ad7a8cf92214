"""What a shard stores at each position is the target's own state for that token.

Hidden convention (the shard table of docs/data.md): hidden[t] is the last decoder layer's
output h_t BEFORE the final norm; aux_hidden[t, j] is decoder layer aux[j]'s output (HF
hidden_states[aux[j] + 1]).
Checked on a packed, length-sorted batch of sequences of different lengths against the engine
run one sequence at a time and against transformers, at bf16 storage tolerance.
"""
from __future__ import annotations

import pytest
import torch

from inference_eval.engine.attention import BatchLayout, make_backend
from inference_eval.engine.target import TargetConfig, load_target
from precompute.config import PrecomputeConfig
from precompute.data import TokenizedRecord
from precompute.dump import build_shard
from precompute.plan import plan_batches
from precompute.shard_io import read_shard, write_shard

LENGTHS = [37, 5, 64, 18, 2, 41]
BATCH_TOKENS = 160  # packs [64, 41] and [37, 18, 5, 2]: several sequences per forward pass


@pytest.fixture(scope="module")
def case(tiny_hf):
    hf_dir, hf = tiny_hf("smollm2")
    loaded = load_target(TargetConfig(name="tiny_hf", source="hf", path=str(hf_dir)),
                         with_tokenizer=False)
    g = torch.Generator().manual_seed(0)
    records = [TokenizedRecord(id=f"r{i}", loss_mask=[i % 2] * n,
                               input_ids=torch.randint(3, 320, (n,), generator=g).tolist())
               for i, n in enumerate(LENGTHS)]
    return loaded.model, hf, records


def hf_states(hf, ids: list[int]) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """transformers' last decoder layer output (pre-norm, via a hook) and hidden_states."""
    got = {}

    def hook(_module, _args, output):
        got["last"] = output[0] if isinstance(output, tuple) else output

    handle = hf.model.layers[-1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = hf(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        handle.remove()
    return got["last"][0], tuple(h[0] for h in out.hidden_states)


def engine_states(model, ids: list[int], aux: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine alone on one sequence: (hidden [T, H], aux [T, A, H]) fp32."""
    plan = make_backend("torch").plan(BatchLayout.packed([len(ids)]))
    with torch.inference_mode():
        out = model(torch.tensor(ids), plan, None, compute_logits=False, aux_layers=aux)
    return out.hidden, out.aux


def assert_bf16_close(stored: torch.Tensor, ref: torch.Tensor) -> None:
    # bf16 keeps 8 significant bits: rounding error <= 2^-9 relative, plus fp32 noise between
    # a batched and a single-sequence forward.
    torch.testing.assert_close(stored.float(), ref.float(), rtol=2 ** -8, atol=1e-4)


def test_batches_are_packed_with_sequences_of_different_lengths():
    batches = plan_batches(range(len(LENGTHS)), LENGTHS, BATCH_TOKENS)
    assert len(batches) < len(LENGTHS)
    assert any(len({LENGTHS[i] for i in b}) > 1 for b in batches)


def test_stored_hidden_is_the_pre_norm_last_layer_state_at_every_position(case, tmp_path):
    model, hf, records = case
    aux = PrecomputeConfig(aux="eagle3").aux_layer_ids(model.arch.num_layers)
    assert aux == [0, 1]  # 3 layers: eagle3's (1, L/2-1, L-4) clamped into range
    shard = build_shard(model, make_backend("torch"), records, batch_tokens=BATCH_TOKENS,
                        aux_layers=aux, hidden_dtype="bfloat16")
    digest = write_shard(tmp_path / "shard_00000.safetensors", shard)
    shard = read_shard(tmp_path / "shard_00000.safetensors", digest)
    assert shard.hidden.dtype == torch.bfloat16 and shard.aux_hidden.shape[1:] == (2, 96)
    assert shard.record_ids == [r.id for r in records]
    for i, rec in enumerate(records):
        a, b = int(shard.cu_seqlens[i]), int(shard.cu_seqlens[i + 1])
        assert shard.input_ids[a:b].tolist() == rec.input_ids
        assert shard.loss_mask[a:b].tolist() == rec.loss_mask
        ours, ours_aux = engine_states(model, rec.input_ids, aux)
        hf_last, hf_hidden = hf_states(hf, rec.input_ids)
        assert_bf16_close(shard.hidden[a:b], ours)
        assert_bf16_close(shard.hidden[a:b], hf_last)
        for j, layer in enumerate(aux):
            assert_bf16_close(shard.aux_hidden[a:b, j], ours_aux[:, j])
            assert_bf16_close(shard.aux_hidden[a:b, j], hf_hidden[layer + 1])
        # Pre-norm for real: HF's final norm of our stored state is its post-norm output.
        post = hf.model.norm(shard.hidden[a:b].float())
        torch.testing.assert_close(post, hf.model.norm(hf_last), rtol=2 ** -6, atol=1e-3)
        assert not torch.allclose(shard.hidden[a:b].float(), post, atol=1e-2)


def test_fp8_hidden_matches_the_engine_within_fp8_tolerance(case):
    model, _, records = case
    shard = build_shard(model, make_backend("torch"), records, batch_tokens=BATCH_TOKENS,
                        aux_layers=[0], hidden_dtype="fp8")
    assert shard.hidden.dtype == torch.float8_e4m3fn and shard.hidden_scale.shape == (sum(LENGTHS),)
    assert shard.aux_hidden.dtype == torch.bfloat16  # aux inputs keep bf16
    dequant = shard.hidden_float()
    for i, rec in enumerate(records):
        a, b = int(shard.cu_seqlens[i]), int(shard.cu_seqlens[i + 1])
        ref, _ = engine_states(model, rec.input_ids, [0])
        got = dequant[a:b]
        row_max = ref.abs().amax(dim=1, keepdim=True)
        bound = 2 ** -4 * ref.abs() + row_max / 448 * 2 ** -9 + 1e-5  # see test_shards
        assert bool(((got - ref).abs() <= bound).all())
