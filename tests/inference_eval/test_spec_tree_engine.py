"""EAGLE-2 trees in the engine: greedy output equals autoregressive output, an oracle draft
gets every tree round fully accepted (so scratch masks, positions and the KV compaction of
accepted paths are exercised), and sampled tree speculation keeps the target's law."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from heads.checkpoint import save_head
from heads.config import HeadConfig
from heads.registry import build_head
from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.kv_cache import KVCache
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.speculative.drafters import HeadDrafter
from inference_eval.evaluation.engines import build_engine, frozen_parts_of
from inference_eval.engine.speculative.tree_engine import TreeSpecEngine
from inference_eval.engine.target import TargetConfig
from spec_stats import chi2_pvalue, first_two_counts, joint_first_two
from engine_cases import load_tiny as _loaded, random_prompts

BOS = 1


def _prompts(k=6, seed=21):
    return random_prompts(k, seed, 30, bos=BOS)


def _ar(loaded, prompts, params):
    eng = LLMEngine(loaded.model, None, EngineConfig(attention="torch", page_size=4))
    return [r.token_ids for r in eng.generate(prompts, params, progress=False)]


def _tree_cfg(path, depth=3, topk=4, total=8):
    return SimpleNamespace(kind="head", checkpoint=str(path), scheme="tree", num_draft=depth,
                           depth=depth, topk=topk, total_tokens=total)


class OracleDrafter(HeadDrafter):
    """The target itself in the head's slots: the head's entry j (token x_{j+1}) is stored
    at cache index j+1 with rotary position j+1, and index 0 holds x_0 (= BOS in these tests),
    so its logits are the target's exact predictions. Every layout the engine plans for the
    head (prefill refills, tree scratch with its masks, catch-up refills) is replayed one index
    to the right, so a wrong mask, position or slot shows up as a rejected draft."""

    def __init__(self, model, num_pages, page_size, device, dtype) -> None:
        a = model.arch
        self.model, self.page_size = model, page_size
        self.cache = KVCache(a.num_layers, num_pages, page_size, a.num_kv_heads, a.head_dim,
                             dtype, device)
        self.aux_layers, self.carry, self.d2t = [], {}, None

    def run(self, tokens, state, plan, rows=None, k=1):
        lay = plan.layout
        fresh = [q == kv for q, kv in zip(lay.q_lens, lay.kv_lens)]  # prefill from index 0
        pos, toks, keep, cu = lay.position_tensor() + 1, [], [], lay.cu_q()
        positions = []
        for b, f in enumerate(fresh):
            seg = tokens[cu[b]:cu[b + 1]]
            if f:
                toks.append(torch.tensor([BOS]))
                positions.append(torch.tensor([0]))
            keep.extend(range(sum(len(t) for t in toks), sum(len(t) for t in toks) + len(seg)))
            toks.append(seg)
            positions.append(pos[cu[b]:cu[b + 1]])
        shifted = BatchLayout([q + f for q, f in zip(lay.q_lens, fresh)], [kv + 1 for kv in lay.kv_lens],
                              lay.block_tables, lay.page_size, positions=torch.cat(positions),
                              tree_masks=lay.tree_masks)
        from inference_eval.engine.attention.torch_backend import TorchAttentionBackend

        out = self.model(torch.cat(toks), TorchAttentionBackend().plan(shifted), self.cache)
        logits = out.logits[torch.tensor(keep)].float()
        return torch.zeros(len(keep), self.model.arch.hidden_size), logits

    def use_cpu_blas(self, enabled):  # the target's own setting already applies
        pass

    def refill(self, rids, tokens, target_hidden, target_aux, plan, last_rows):
        nxt, logits = self.run(tokens, None, plan)
        for rid, row in zip(rids, last_rows):
            self.carry[rid] = (nxt[row], logits[row])


@pytest.mark.parametrize("depth,topk,total", [(1, 3, 3), (3, 4, 8), (4, 3, 12)])
def test_random_head_tree_greedy_is_lossless(tiny_hf, tmp_path, depth, topk, total):
    loaded = _loaded(tiny_hf)
    head = build_head(HeadConfig(type="mtp"), frozen_parts_of(loaded), seed=3)
    with torch.no_grad():
        head.final_norm.weight.mul_(20.0)  # some agreement, so some nodes are accepted
    save_head(head, tmp_path / "h")
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 14, 20, 5, 17, 12)]
    prompts = _prompts()
    eng = build_engine(loaded, EngineConfig(attention="torch", page_size=4),
                      _tree_cfg(tmp_path / "h", depth, topk, total))
    assert isinstance(eng, TreeSpecEngine)
    out = eng.generate(prompts, params, progress=False)
    assert [r.token_ids for r in out] == _ar(loaded, prompts, params)
    for r in out:
        assert max(r.meta["proposed"]) <= depth
        assert len(r.token_ids) == r.meta["target_steps"] + sum(r.meta["accepted"])


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_oracle_tree_accepts_every_level(tiny_hf, family):
    loaded = _loaded(tiny_hf, family)
    depth = 4
    eng = TreeSpecEngine(loaded.model, None, EngineConfig(attention="torch", page_size=4),
                         lambda p, ps, d, dt: OracleDrafter(loaded.model, p, ps, d, dt),
                         depth=depth, topk=2, total_tokens=30, frontier=8)
    # A full binary tree (2+4+8+16 = 30 nodes): nothing is cut by the frontier or the prune,
    # which on a random target's flat distributions could drop the greedy path.
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (21, 13, 30)]
    prompts = _prompts(3, seed=4)
    out = eng.generate(prompts, params, progress=False)
    assert [r.token_ids for r in out] == _ar(loaded, prompts, params)
    for r in out:
        # Every round after the prefill accepts its whole depth (shrunk only near the end).
        assert r.meta["accepted"][1:] == r.meta["proposed"][1:]
        assert max(r.meta["proposed"]) == depth


def test_oracle_tree_with_narrow_context_and_preemption(tiny_hf):
    """Few pages force preemption (recompute) mid-run; the tree still matches AR output."""
    loaded = _loaded(tiny_hf)
    cfg = EngineConfig(attention="torch", page_size=4, num_pages=40)
    eng = TreeSpecEngine(loaded.model, None, cfg,
                         lambda p, ps, d, dt: OracleDrafter(loaded.model, p, ps, d, dt),
                         depth=3, topk=2, total_tokens=10)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    prompts = _prompts(6, seed=8)
    out = eng.generate(prompts, params, progress=False)
    assert [r.token_ids for r in out] == _ar(loaded, prompts, params)


def test_tree_needs_a_head(tiny_hf):
    loaded = _loaded(tiny_hf)
    hf_dir, _ = tiny_hf("smollm2")
    with pytest.raises(ValueError, match="scheme=tree needs draft=head"):
        build_engine(loaded, EngineConfig(attention="torch"),
                    SimpleNamespace(kind="llm", num_draft=2, scheme="tree", depth=2, topk=2,
                                    total_tokens=4,
                                    llm=TargetConfig(name="d", source="hf", path=str(hf_dir))))


def test_scratch_mask_is_ancestors_and_self():
    # Nodes: 0 root; 1, 2 children of root (depth 1, scratch 0 and 1); 3 child of 2, 4 child
    # of 1 (depth 2, frontier slots 0, 1 -> scratch 2, 3); frontier slot 2 is empty.
    parents = torch.tensor([[-1, 0, 0, 2, 1]])
    slot = torch.tensor([[-1, 0, 1, 2, 3]])
    frontier = torch.tensor([[3, 4, -1]])
    got = TreeSpecEngine._scratch_mask(parents, frontier, slot, 6)
    want = [[0, 1, 1, 0, 0, 0],   # node 3: itself (2) and its parent 2 (scratch 1)
            [1, 0, 0, 1, 0, 0],   # node 4: itself (3) and its parent 1 (scratch 0)
            [0, 0, 0, 0, 0, 1]]   # empty slot: only its own entry 6 - 3 + 2
    assert got[0].int().tolist() == want


def test_sampled_tree_matches_target_distribution(tiny_hf):
    """Temperature 0.8, top-k 4: the joint law of the first two generated tokens (the second
    comes from a tree round) equals the target's exact joint law. The oracle draft's top-2
    children are accepted often but not always, so both branches of the rule run."""
    loaded = _loaded(tiny_hf)
    prompt = _prompts(1, seed=9)[0]
    params = SamplingParams(temperature=0.8, top_k=4, max_new_tokens=3, ignore_eos=True)
    joint = joint_first_two(loaded.model, prompt, params)
    cfg = EngineConfig(attention="torch", page_size=4, max_batch_size=4096, seed=123)
    eng = TreeSpecEngine(loaded.model, None, cfg,
                         lambda p, ps, d, dt: OracleDrafter(loaded.model, p, ps, d, dt),
                         depth=2, topk=2, total_tokens=4)
    trials = 3000
    out = eng.generate([prompt] * trials, params, progress=False)
    counts = first_two_counts(out, 320)
    accepted = sum(r.meta["accepted"][1] for r in out)
    assert 0.05 * trials < accepted < 0.95 * trials
    assert chi2_pvalue(counts, joint) > 1e-4
