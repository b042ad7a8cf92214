"""The sync-free MTP round (draft.sync_free): the head catches up on the verify pass's own
layout before the host learns the accepted lengths. Greedy output stays the autoregressive
output, drafts are accepted, the rounds are the same as with the catch-up after the sync, and
every round reads the device once."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from heads.checkpoint import save_head
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.target import TargetConfig, load_target
from inference_eval.evaluation.config import DraftConfig
from inference_eval.evaluation.engines import build_engine
from fit_head import fit_head_on

CFG = dict(attention="torch", page_size=4)


@pytest.fixture
def setup(tiny_hf, tmp_path):
    hf_dir, _ = tiny_hf("llama3")
    loaded = load_target(TargetConfig(name="llama3", source="hf", path=str(hf_dir)),
                         with_tokenizer=False)
    g = torch.Generator().manual_seed(21)
    prompts = [[1] + torch.randint(3, 320, (int(torch.randint(3, 30, (1,), generator=g)),),
                                   generator=g).tolist() for _ in range(6)]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 14, 20, 5, 17, 12)]
    # Fit the head on the target's own greedy continuations (seconds on the tiny target), so
    # it accepts far above chance and the accepted rows of the cache matter.
    ar = LLMEngine(loaded.model, None, EngineConfig(**CFG)).generate(
        prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), progress=False)
    head = fit_head_on(loaded, [r.prompt_ids + r.token_ids for r in ar])
    save_head(head, tmp_path / "mtp")
    return loaded, str(tmp_path / "mtp"), prompts, params


def _draft(ck, sync_free):
    return SimpleNamespace(kind="head", checkpoint=ck, num_draft=3, scheme="chain",
                           sync_free=sync_free)


def test_sync_free_round_is_lossless_and_matches_the_synced_round(setup):
    loaded, ck, prompts, params = setup
    ar = LLMEngine(loaded.model, None, EngineConfig(**CFG)).generate(prompts, params, progress=False)
    runs = {}
    for sync_free in (False, True):
        eng = build_engine(loaded, EngineConfig(**CFG), _draft(ck, sync_free))
        assert eng.drafter.sync_free is sync_free
        out = eng.generate(prompts, params, progress=False)
        assert [r.token_ids for r in out] == [r.token_ids for r in ar]
        assert eng.counters["host_syncs"] == eng.counters["rounds"] > 0  # one read per round
        runs[sync_free] = out
    proposed = sum(sum(r.meta["proposed"]) for r in runs[True])
    accepted = sum(sum(r.meta["accepted"]) for r in runs[True])
    assert accepted > 0.3 * proposed, (accepted, proposed)  # drafts were accepted
    # The same drafts are judged and accepted round by round: the head's cache holds the
    # same entries whichever way it caught up.
    assert [r.meta["accepted"] for r in runs[True]] == [r.meta["accepted"] for r in runs[False]]


def test_sync_free_is_refused_where_it_cannot_apply():
    with pytest.raises(ValueError, match="draft.sync_free applies to head chains"):
        DraftConfig(kind="head", checkpoint="ck", scheme="tree", sync_free=True)
    with pytest.raises(ValueError, match="draft.sync_free applies to head chains"):
        DraftConfig(kind="llm", llm=TargetConfig(), sync_free=True)
