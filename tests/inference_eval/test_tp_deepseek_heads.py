"""Draft heads over DeepSeek targets at tensor-parallel size 2 (gloo ranks on the CPU, tiny
random targets: latent attention, MoE layers with shared experts; V2-Lite-like with a dense
first layer, V3-like with none): an MTP head (MLA + a dense MLP), an MTP head whose layer is
an MoE layer (head.moe=true) and an EAGLE-3 head, with the target's experts split TP-MoE and
EP (chains; an MoE head's EAGLE-2 tree, an MTP head's sync-free round), are lossless (greedy
= autoregressive), with drafts accepted, and accept per round exactly what the same drafter
accepts at size 1. The head's MLA layer splits as the target's (query heads across ranks,
the latent cache whole on every rank), its MLP by its own kind, whatever the kind of the
target's layer 0."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from heads.batch import PackedBatch
from heads.checkpoint import save_head
from heads.config import HeadConfig
from heads.registry import build_head
from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionBackend
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.target import TargetConfig, load_target
from inference_eval.evaluation.engines import build_engine, frozen_parts_of
from engine_cases import random_prompts
from fit_head import train_steps
from tiny_hf_models import make_tiny_deepseek
from tp_ranks import assert_lossless_as_tp1, leader_result, run_ranks, spec_summary

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINE = dict(attention="torch", page_size=4, num_pages=128, head_code="none")
AUX = [0, 1, 2]
MAX_NEW = [14, 9, 16, 12]
CHAIN = dict(kind="head", num_draft=3, scheme="chain")
HEADS = {  # checkpoint -> head config
    "mtp": dict(type="mtp"),
    "mtp_moe": dict(type="mtp", moe=True),
    "eagle3": dict(type="eagle3", aux_layers=AUX),
}
# v2_lite: layer 0 dense, so an MoE head's experts have no target layer 0 to copy a split
# from; v3_half: layer 0 MoE, so neither has a dense head's MLP.
FAMILIES = ("v2_lite", "v3_half")
TREE = dict(kind="head", scheme="tree", depth=3, topk=2, total_tokens=6)
SCHEMES = {"chain": CHAIN, "sync_free": dict(CHAIN, sync_free=True), "tree": TREE}
CASES = {  # case -> (target family, checkpoint, expert_parallel, scheme)
    "mtp_tp": ("v2_lite", "mtp", False, "chain"),
    "mtp_ep": ("v2_lite", "mtp", True, "chain"),
    "mtp_moe_tp": ("v2_lite", "mtp_moe", False, "chain"),
    "mtp_moe_ep": ("v2_lite", "mtp_moe", True, "chain"),
    "eagle3_tp": ("v2_lite", "eagle3", False, "chain"),
    "eagle3_ep": ("v2_lite", "eagle3", True, "chain"),
    "mtp_moe_tree_ep": ("v2_lite", "mtp_moe", True, "tree"),
    "mtp_sync_free_tp": ("v2_lite", "mtp", False, "sync_free"),
    "half_mtp_ep": ("v3_half", "mtp", True, "chain"),
    "half_mtp_moe_tp": ("v3_half", "mtp_moe", False, "chain"),
}


def _fit(loaded, seqs, kind: dict, steps: int = 60):
    """A head fitted on the target's own greedy text (every position a label), so its drafts
    are accepted far above chance."""
    ids, lens = torch.tensor([t for s in seqs for t in s]), [len(s) for s in seqs]
    with torch.no_grad():
        out = loaded.model(ids, TorchAttentionBackend().plan(BatchLayout.packed(lens)), None,
                           compute_logits=False, aux_layers=AUX)
    head = build_head(HeadConfig(**kind), frozen_parts_of(loaded), seed=0)
    batch = PackedBatch(ids, out.hidden.float(), torch.ones(len(ids), dtype=torch.bool), lens,
                        out.aux.float())
    return train_steps(head, batch, steps, 3e-3, seed=0).eval()


def _draft(tmp, family: str, ckpt: str, scheme: str = "chain"):
    return SimpleNamespace(**SCHEMES[scheme], checkpoint=str(tmp / family / "heads" / ckpt))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(TP=2 results per rank, TP=1 results per (family, checkpoint, scheme), autoregressive
    tokens per family)."""
    tmp = tmp_path_factory.mktemp("tp_deepseek_heads")
    prompts = random_prompts(4, 21, 20, bos=None)
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    one, ar = {}, {}
    for family in FAMILIES:
        make_tiny_deepseek(family, tmp / family)
        loaded = load_target(TargetConfig(name="deepseek", source="hf", path=str(tmp / family)),
                             with_tokenizer=False)
        ar[family] = [r.token_ids for r in LLMEngine(loaded.model, None, EngineConfig(
            **ENGINE)).generate(prompts, params, progress=False)]
        text = [p + t for p, t in zip(prompts, ar[family])]
        for ckpt, kind in HEADS.items():
            if any(c[:2] == (family, ckpt) for c in CASES.values()):
                save_head(_fit(loaded, text, kind), tmp / family / "heads" / ckpt)
        for ckpt, scheme in {(c[1], c[3]) for c in CASES.values() if c[0] == family}:
            draft = _draft(tmp, family, ckpt, scheme)
            engine = build_engine(loaded, EngineConfig(**ENGINE), draft)
            one[family, ckpt, scheme] = spec_summary(
                engine.generate(prompts, params, progress=False), engine)
    cases = {name: (str(tmp / family), _draft(tmp, family, ckpt, scheme), ep)
             for name, (family, ckpt, ep, scheme) in CASES.items()}
    results = run_ranks("deepseek_heads_worker", 2, cases, prompts, MAX_NEW, ENGINE, tmp=tmp,
                        timeout=240)
    leader_result(results)
    return [r["ok"] for r in results], one, ar


@pytest.mark.parametrize("name", CASES)
def test_tp2_is_lossless_and_accepts_as_tp1(runs, name):
    ranks, one, ar = runs
    family, ckpt, _, scheme = CASES[name]
    got, ref = ranks[0][name], one[family, ckpt, scheme]
    assert_lossless_as_tp1(got, ref, ar[family], name)


def test_head_layer_splits_as_the_targets(runs):
    """On both ranks: the head's MLA layer holds half the query heads (4 -> 2) and caches the
    whole latent row [1, r + p] = [1, 32 + 8], like the target's MLA layers; an MoE head's
    experts split as the target's: TP-MoE each expert's 24 intermediate rows in half (8
    experts of [2 * 12, 64]), EP whole experts (4 of [2 * 24, 64] per rank); a dense head's
    MLP stays dense whatever the target's experts do."""
    moe = {"mtp_moe_tp": (8, 24, 64), "mtp_moe_ep": (4, 48, 64),
           "mtp_moe_tree_ep": (4, 48, 64), "half_mtp_moe_tp": (8, 24, 64)}
    for rank, got in enumerate(runs[0]):
        for name in CASES:
            split = got[name]["split"]
            assert split["query_heads"] == 2, (rank, name, split)
            assert split["cache_row"] == (1, 40) and split["cache_latent"], (rank, name, split)
            if name in moe:
                assert (split["mlp"], split["experts"]) == ("ParallelMoE", moe[name]), (rank, name)
            else:
                assert (split["mlp"], split["experts"]) == ("MLP", None), (rank, name, split)


@pytest.mark.parametrize("name", CASES)
def test_draft_step_collectives(runs, name):
    """A draft step: one broadcast, the shared embedding's all-reduce, one after MLA's o_proj
    and one after the MLP or MoE (routed and shared experts summed together, EP too), the
    shared lm_head's gather."""
    assert runs[0][0][name]["step_calls"] == {"broadcast": 1, "all_reduce": 3, "gather": 1}
