"""engine.head_code: a draft head's trained weights rounded to a GGUF block code on the CPU
fast path (cpu_quant.code_weights), so its small-row products read the code. The drafts must
be exactly the rollout's of the same rounded head, and nothing frozen may change."""
from __future__ import annotations

import copy

import pytest
import torch

from heads.batch import PackedBatch
from heads.config import HeadConfig
from heads.frozen import load_frozen
from heads.registry import build_head
from heads.rollout import rollout
from heads.vocab import build_draft_vocab
from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionBackend
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.model import cpu_quant
from inference_eval.engine.model.linear import Linear
from inference_eval.engine.speculative.drafters import HeadDrafter
from inference_eval.engine.target import TargetConfig

# Shapes the block-code kernel takes (every `in` a multiple of 32, every `out` of 8).
TINY = TargetConfig(name="tiny-code", source="random", path=None, seed=5, arch=dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16, tie_word_embeddings=True))

@pytest.fixture(scope="module")
def parts():
    # No skip without the kernel: where torch's toolchain builds anything it must build this
    # (test_cpu_quant.test_kernel_builds), and without it nothing here would be exercised.
    assert cpu_quant.kernel() is not None
    return load_frozen(TINY)


def _head(parts, reduced: bool):
    vocab = None
    if reduced:
        ids = torch.randint(0, 320, (3000,), generator=torch.Generator().manual_seed(2)) % 120
        vocab = build_draft_vocab(ids, torch.ones_like(ids), 320, 48)
    cfg = HeadConfig(type="mtp", num_steps=2, draft_vocab_size=48 if reduced else None)
    head = build_head(cfg, parts, draft_vocab=vocab, seed=4)
    with torch.no_grad():  # trained-looking weights: no block code of their own
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    return head


def _bound(head, code):
    n, page = 19, 4
    drafter = HeadDrafter(head, -(-n // page), page, "cpu", torch.float32)
    drafter.bind(TorchAttentionBackend("cpu"), True, True, code)
    plan = TorchAttentionBackend("cpu").plan(BatchLayout([n], [n], [list(range(-(-n // page)))], page))
    return drafter, plan, n


@pytest.mark.parametrize("reduced", [False, True])
def test_q8_0_head_drafts_what_its_rounded_rollout_predicts(parts, reduced):
    head = _head(parts, reduced)
    reference = copy.deepcopy(head)
    frozen_before = parts.lm_head.clone()
    rows_before = None if head.draft_rows is None else head.draft_rows.clone()
    n_linear = sum(isinstance(m, Linear) for m in reference.modules())
    assert n_linear >= 5 and cpu_quant.code_weights(reference, "q8_0") == n_linear
    drafter, plan, n = _bound(head, "q8_0")
    linears = [m for m in head.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.packed.fmt == 8 for m in linears)
    for (name, p), (_, q) in zip(head.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, q), name  # the engine's head is the reference's rounding
    assert torch.equal(parts.lm_head, frozen_before)  # the target's lm_head is untouched
    if rows_before is not None:
        assert torch.equal(head.draft_rows, rows_before)
    g = torch.Generator().manual_seed(1)
    b = PackedBatch(torch.randint(0, 320, (n,), generator=g), torch.randn(n, 64, generator=g),
                    torch.ones(n, dtype=torch.bool), [n])
    with torch.no_grad():
        want = reference.logits(rollout(reference, b)[0].features)
        d2t = reference.draft_to_target()
        want_ids = want.argmax(-1) if d2t is None else d2t[want.argmax(-1)]
        tokens = torch.cat([b.input_ids[1:], b.input_ids[:1] * 0])  # x_{t+1}: rollout step 1
        _, logits = drafter.run(tokens, head.first_hidden(b.hidden, None), plan)
    assert torch.equal(logits.argmax(-1)[:-1], want_ids[:-1])
    got = logits[:-1] if d2t is None else logits[:-1, d2t]
    torch.testing.assert_close(got, want[:-1], rtol=1e-5, atol=1e-5)


def test_head_code_none_keeps_the_trained_floats(parts):
    head = _head(parts, False)
    before = {k: v.clone() for k, v in head.named_parameters()}
    _bound(head, "none")
    assert all(torch.equal(p, before[k]) for k, p in head.named_parameters())
    assert head.eh_proj.packed is None  # trained floats have no exact code: the fp32 kernel


def test_rounding_changes_the_floats_a_little(parts):
    head = _head(parts, False)
    w = head.layer.mlp.down_proj.weight.detach().clone()
    r = cpu_quant.gguf_round_trip(w, 8)
    assert not torch.equal(r, w)
    assert (r - w).abs().max() <= w.abs().max() / 127  # within one step of the largest block scale
    assert torch.equal(cpu_quant.gguf_round_trip(r, 8), r)  # idempotent: exact codes stay


def test_engine_config_refuses_an_unknown_code():
    with pytest.raises(ValueError, match="engine.head_code"):
        EngineConfig(head_code="int3")
