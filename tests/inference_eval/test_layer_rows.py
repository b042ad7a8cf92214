"""DecoderLayer's `rows`: only some rows' outputs are wanted (a block drafter's last layer,
whose anchor row feeds no logits). Every row still writes its keys and values and reaches the
attention; the rows' outputs equal the full layer's, on torch's ops and on the CPU fast path,
for grouped-query (with and without q/k norms) and latent attention."""
from __future__ import annotations

import pytest
import torch

from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionBackend
from inference_eval.engine.kv_cache import KVCache
from inference_eval.engine.model.arch import ModelArch
from inference_eval.engine.model.layers import DecoderLayer
from inference_eval.engine.model.linear import set_cpu_blas
from inference_eval.engine.model.rope import arch_rope_tables
from inference_eval.engine.model.transformer import StepContext

GQA = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16)
MLA = dict(architecture="DeepseekV2ForCausalLM", hidden_size=64, intermediate_size=128,
           num_heads=4, num_kv_heads=1, head_dim=24, q_lora_rank=None, kv_lora_rank=32,
           qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


def _run(layer, arch, x, rows, fast, cached: int = 6):
    """The layer over `cached` positions already in a paged cache, then x [T, H] as new rows
    -> (output, the cache's layer 0 after the step)."""
    gen = torch.Generator().manual_seed(1)
    cache = KVCache.for_arch(arch, num_pages=8, page_size=4)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    if cache.v is not None:
        cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    t = x.shape[0]
    lay = BatchLayout([t], [cached + t], [list(range(8))], 4,
                      tree_masks=[torch.ones(t, t, dtype=torch.bool)])
    plan = TorchAttentionBackend().plan(lay)
    cos, sin = arch_rope_tables(arch)
    set_cpu_blas(layer, fast)
    with torch.inference_mode():
        out = layer(x, StepContext(cos[plan.positions], sin[plan.positions], plan, cache), rows=rows)
    return out, [c.clone() for c in cache.layer(0) if c is not None]


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("kind", ["gqa", "gqa_qk_norm", "mla"])
def test_rows_equal_the_full_layers_rows(kind, fast):
    arch = ModelArch(**(MLA if kind == "mla" else GQA), qk_norm=kind == "gqa_qk_norm")
    torch.manual_seed(0)
    layer = DecoderLayer(arch, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    x = torch.randn(4, arch.hidden_size)
    rows = torch.tensor([1, 2, 3])
    full, cache_full = _run(layer, arch, x, None, fast)
    part, cache_part = _run(layer, arch, x, rows, fast)
    assert part.shape == (3, arch.hidden_size)
    torch.testing.assert_close(part, full[rows], rtol=1e-5, atol=1e-5)
    for a, b in zip(cache_full, cache_part):  # the anchor row's keys and values were written
        assert torch.equal(a, b)
    # The anchor row's input matters to the kept rows (they attend to it).
    x2 = x.clone()
    x2[0] += 1.0
    other, _ = _run(layer, arch, x2, rows, fast)
    assert not torch.allclose(other, part, atol=1e-4)
