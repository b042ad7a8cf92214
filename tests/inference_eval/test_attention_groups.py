"""The torch backend's kv-length groups (inference_eval/engine/attention/torch_backend.py): a
step whose requests have very different cache lengths runs one SDPA per group of similar
lengths, and gives what the single padded batch gives."""
from __future__ import annotations

import itertools

import pytest
import torch

from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionPlan, kv_groups
from inference_eval.engine.kv_cache import KVCache


def brute_force_groups(lens, cost):
    """Every contiguous partition of the length-sorted order, cheapest first."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    best = None
    for cuts in itertools.product([0, 1], repeat=len(lens) - 1):
        groups, cur = [], [order[0]]
        for c, i in zip(cuts, order[1:]):
            if c:
                groups.append(cur)
                cur = []
            cur.append(i)
        groups.append(cur)
        total = sum(len(g) * lens[g[0]] + cost for g in groups)
        if best is None or total < best[0]:
            best = (total, groups)
    return best[0]


def paged_layout(q_lens, kv_lens, page):
    """The step's layout on interleaved pages, as an allocator hands them out; its page count."""
    tables, nxt = [], 0
    for kv in kv_lens:
        n = -(-kv // page)
        tables.append(list(range(nxt, nxt + n))[::-1])
        nxt += n
    return BatchLayout(q_lens, kv_lens, tables, page), nxt


def attend_both(plans, pages, page, heads, kvh, d, g):
    """Both plans attend the same random q, k, v rows, each over its own one-layer cache of
    the same random keys and values: ([out a, out b], [cache a, cache b])."""
    t = plans[0].num_tokens
    q, k, v = (torch.randn(t, n, d, generator=g) for n in (heads, kvh, kvh))
    caches = []
    for _ in range(2):
        c = KVCache(1, pages, page, kvh, d, torch.float32, "cpu")
        kc, vc = c.layer(0)
        torch.manual_seed(1)
        kc.copy_(torch.randn(kc.shape))
        vc.copy_(torch.randn(vc.shape))
        caches.append(c)
    return [p.attend(0, q, k, v, c) for p, c in zip(plans, caches)], caches


@pytest.mark.parametrize("lens", [[5, 900, 880, 7, 30, 31, 400], [10, 10, 10], [3000, 2]])
def test_groups_are_the_cheapest_partition(lens):
    groups = kv_groups(lens, 256)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    cost = sum(len(g) * max(lens[i] for i in g) + 256 for g in groups)
    assert cost == brute_force_groups(lens, 256)
    assert kv_groups([10, 10, 10], 256) == [[0, 1, 2]]  # similar lengths: one group


# The third: the short requests are fresh prompts (q_len == kv_len) beside decodes, so their
# group is all fresh (a self-distillation step admitting new prompts crashed on it once).
@pytest.mark.parametrize("q_lens", [[1] * 6, [1, 4, 1, 3, 1, 1], [9, 1, 1, 12, 1, 5]])
def test_grouped_attention_equals_one_padded_batch(q_lens):
    g = torch.Generator().manual_seed(0)
    kv_lens = [9, 700, 650, 12, 300, 5]
    page, kvh, heads, d = 8, 2, 4, 16
    layout, nxt = paged_layout(q_lens, kv_lens, page)
    grouped = TorchAttentionPlan(layout, torch.device("cpu"))
    plain = TorchAttentionPlan(layout, torch.device("cpu"), grouped=False)
    assert grouped.groups is not None and len(grouped.groups) > 1 and plain.groups is None
    (a, b), caches = attend_both((grouped, plain), nxt, page, heads, kvh, d, g)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(caches[0].layer(0)[0], caches[1].layer(0)[0], rtol=0, atol=0)


@pytest.mark.parametrize("q_len", [1, 4])
def test_consecutive_pages_read_as_one_slice_equal_the_gather(q_len):
    """Batch 1 on consecutive pages reads its keys as a slice of the cache (no gather); the
    same keys on scattered pages go through the gather; both attend alike."""
    ps, kv, heads, kvh, d = 4, 13, 4, 2, 8
    g = torch.Generator().manual_seed(0)
    k_all, v_all = torch.randn(kv, kvh, d, generator=g), torch.randn(kv, kvh, d, generator=g)
    q = torch.randn(q_len, heads, d, generator=g)
    outs = []
    for table in ([2, 3, 4, 5], [7, 1, 5, 3]):
        cache = KVCache(1, 8, ps, kvh, d)
        old = BatchLayout([kv - q_len], [kv - q_len], [table], ps)
        TorchAttentionPlan(old, "cpu").attend(0, q[:1].expand(kv - q_len, -1, -1).contiguous(),
                                               k_all[:kv - q_len], v_all[:kv - q_len], cache)
        plan = TorchAttentionPlan(BatchLayout([q_len], [kv], [table], ps), "cpu")
        assert (plan.kv_span is not None) == (table == [2, 3, 4, 5])
        outs.append(plan.attend(0, q, k_all[kv - q_len:], v_all[kv - q_len:], cache))
    torch.testing.assert_close(outs[0], outs[1])


@pytest.mark.parametrize("q_lens", [[40, 1, 1, 3, 1, 25], [1, 1, 64, 1, 1, 1]])
def test_mixed_step_splits_into_prompts_and_decodes(q_lens):
    """Fresh prompts (q_len == kv_len, longer than cpu_paged.SMALL_Q) admitted beside decode
    rows: the prompts attend on the causal path, the rest in cpu_paged's kernel; outputs and
    the cache equal the single padded batch's."""
    from inference_eval.engine.attention import cpu_causal, cpu_paged
    assert cpu_paged.kernel() is not None  # built by scripts/setup_env.sh, as the paged tests need
    g = torch.Generator().manual_seed(0)
    kv_lens = [q if q > cpu_paged.SMALL_Q else kv for q, kv in zip(q_lens, [9, 300, 70, 12, 5, 6])]
    page, kvh, heads, d = 8, 2, 4, 16
    layout, nxt = paged_layout(q_lens, kv_lens, page)
    split = TorchAttentionPlan(layout, torch.device("cpu"), threads=2, paged_kernel=True,
                               causal_kernel=cpu_causal.kernel() is not None)
    plain = TorchAttentionPlan(layout, torch.device("cpu"), grouped=False)
    assert split.split is not None and plain.split is None and plain.gathered
    (big_rows, big), (small_rows, small) = split.split
    assert big.causal_spans is not None and small.paged is not None
    assert sorted(big_rows.tolist() + small_rows.tolist()) == list(range(sum(q_lens)))
    (a, b), caches = attend_both((split, plain), nxt, page, heads, kvh, d, g)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for x, y in zip(caches[0].layer(0), caches[1].layer(0)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    # A chunk of a prompt (q_len < kv_len past SMALL_Q) is not split: the gathered path.
    chunked = BatchLayout([20, 1], [60, 9], [list(range(8)), [8, 9]], page)
    assert TorchAttentionPlan(chunked, torch.device("cpu"), paged_kernel=True).split is None
