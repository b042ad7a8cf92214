"""Heads with a reduced draft vocabulary and block drafters at tensor-parallel size 2 (gloo
ranks on the CPU, the tiny random Llama target): a two-layer EAGLE-3 chain over its own
V_draft rows, an MTP chain over the target's frozen rows of a draft vocabulary, a two-layer
P-EAGLE (and its sync-free round) and DFlash (full and reduced vocabulary), chains and trees,
are lossless (greedy = autoregressive), with drafts accepted, and accept per round exactly
what the same drafter accepts at size 1."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from heads.batch import PackedBatch
from heads.checkpoint import save_head
from heads.config import HeadConfig
from heads.registry import build_head
from heads.vocab import build_draft_vocab
from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionBackend
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.sampling import SamplingParams
from inference_eval.evaluation.engines import build_engine, frozen_parts_of
from engine_cases import load_tiny, random_prompts
from fit_head import train_steps
from tp_ranks import assert_lossless_as_tp1, leader_result, run_ranks, spec_summary

ENGINE = dict(attention="torch", page_size=4, num_pages=128, head_code="none")
AUX = [0, 1, 2]
MAX_NEW = [14, 9, 16, 12]
V_DRAFT = 64  # of the tiny target's 320 tokens
CHAIN = dict(kind="head", num_draft=3, scheme="chain")
HEADS = {  # case -> (head config, reduced vocabulary)
    "eagle3_reduced": (dict(type="eagle3", num_layers=2), True),  # a two-layer chain
    "mtp_reduced": (dict(type="mtp"), True),
    # two layers: a fused first layer, then a plain one, each split with its own KV heads
    "peagle": (dict(type="eagle3", num_steps=3, parallel_drafting=True, num_layers=2), False),
    "dflash": (dict(type="dflash", num_steps=3, num_layers=2, anchors_per_seq=1000), False),
    "dflash_reduced": (dict(type="dflash", num_steps=3, num_layers=2, anchors_per_seq=1000),
                       True),
    # the transition bias (heads/transition.py): replicated, applied on the leader
    "dflash_markov_reduced": (dict(type="dflash", num_steps=3, num_layers=2, anchors_per_seq=1000,
                                   markov_rank=8), True),
    "peagle_markov": (dict(type="eagle3", num_steps=3, parallel_drafting=True, markov_rank=8),
                      False),
    # DSpark: d_1 biased from the anchor and the confidence head, read on the leader
    "dspark_reduced": (dict(type="dflash", num_steps=3, num_layers=2, anchors_per_seq=1000,
                            markov_rank=8, markov_first=True, confidence_head=True), True),
}


def _fit(loaded, seqs, kind: dict, reduced: bool, steps: int = 60):
    """A head fitted on the target's own greedy text (every position a label), so its drafts
    are accepted far above chance; reduced: over the V_DRAFT most frequent tokens of it."""
    ids, lens = torch.tensor([t for s in seqs for t in s]), [len(s) for s in seqs]
    mask = torch.ones(len(ids), dtype=torch.bool)
    with torch.no_grad():
        out = loaded.model(ids, TorchAttentionBackend().plan(BatchLayout.packed(lens)), None,
                           compute_logits=False, aux_layers=AUX)
    vocab = build_draft_vocab(ids, mask, loaded.model.arch.vocab_size, V_DRAFT) if reduced else None
    aux = {} if kind["type"] == "mtp" else {"aux_layers": AUX}
    cfg = HeadConfig(**kind, **aux, draft_vocab_size=V_DRAFT if reduced else None)
    head = build_head(cfg, frozen_parts_of(loaded), draft_vocab=vocab, seed=0)
    batch = PackedBatch(ids, out.hidden.float(), mask, lens, out.aux.float())
    return train_steps(head, batch, steps, 3e-3, seed=0).eval()


@pytest.fixture(scope="module")
def runs(tiny_hf, tmp_path_factory):
    """(TP=2 results, TP=1 results, autoregressive tokens, the target's arch) per case."""
    tmp = tmp_path_factory.mktemp("tp_block_heads")
    loaded = load_tiny(tiny_hf)
    prompts = random_prompts(4, 21, 20, bos=None)
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    ar = [r.token_ids for r in LLMEngine(loaded.model, None, EngineConfig(**ENGINE)).generate(
        prompts, params, progress=False)]
    text = [p + t for p, t in zip(prompts, ar)]
    cases = {}
    for name, (kind, reduced) in HEADS.items():
        save_head(_fit(loaded, text, kind, reduced), tmp / name)
        cases[name] = SimpleNamespace(**CHAIN, checkpoint=str(tmp / name))
    cases["peagle_sync_free"] = SimpleNamespace(**CHAIN, checkpoint=str(tmp / "peagle"),
                                                sync_free=True)
    cases["dspark_cut"] = SimpleNamespace(**CHAIN, checkpoint=str(tmp / "dspark_reduced"),
                                          min_confidence=0.3)  # the cut reads its head
    for name in ("peagle", "dflash"):  # a tree over the block's per-position top-k
        cases[f"{name}_tree"] = SimpleNamespace(kind="head", scheme="tree", depth=3, topk=2,
                                                total_tokens=6, checkpoint=str(tmp / name))
    one = {}
    for name, draft in cases.items():
        engine = build_engine(loaded, EngineConfig(**ENGINE), draft)
        one[name] = spec_summary(engine.generate(prompts, params, progress=False), engine)
    two = leader_result(run_ranks("block_heads_worker", 2, str(tiny_hf("llama3")[0]), cases,
                                  prompts, MAX_NEW, ENGINE, tmp=tmp, timeout=240))
    return two, one, ar, loaded.model.arch


@pytest.mark.parametrize("name", [*HEADS, "peagle_sync_free", "peagle_tree", "dflash_tree",
                                  "dspark_cut"])
def test_tp2_is_lossless_and_accepts_as_tp1(runs, name):
    two, one, ar, _ = runs
    got, ref = two[name], one[name]
    assert_lossless_as_tp1(got, ref, ar, name)


def test_block_pass_and_context_write_collectives(runs):
    """A DFlash block pass: one broadcast, the embedding's all-reduce and two per layer, the
    shared lm_head's gather; a context write: the broadcast alone (fc and norms replicated,
    each rank writes its KV heads)."""
    calls = runs[0]["dflash"]["calls"]
    layers = HEADS["dflash"][0]["num_layers"]
    assert calls["block"] == {"broadcast": 1, "all_reduce": 1 + 2 * layers, "gather": 1}
    assert calls["context"] == {"broadcast": 1}


def test_reduced_vocabulary_step_gathers_nothing(runs):
    """The draft lm_head's V_draft rows are replicated: a head step is the broadcast, the
    embedding's all-reduce and two per layer, no gather; its logits cover exactly the draft
    vocabulary."""
    calls = runs[0]["eagle3_reduced"]["calls"]
    layers = HEADS["eagle3_reduced"][0]["num_layers"]
    assert calls["step"] == {"broadcast": 1, "all_reduce": 1 + 2 * layers}
    assert calls["finite"] == V_DRAFT
