"""The default self-distillation prompt mix (precompute/data/mix.py): ShareGPT first turns
below the held-out split plus programming requests from the standard library's docs, in the
configured share, and no evaluation problem among them."""
from __future__ import annotations

import re

import pytest

from inference_eval.evaluation.prompts import load_humaneval
from precompute.data import DataConfig, load_conversations, load_prompts
from precompute.data.code_prompts import code_prompts, documented_functions
from precompute.data.config import HELDOUT_SKIP


def test_mix_has_the_code_share_spread_through_it():
    result = load_prompts(DataConfig(source="mix", limit=40, code_share=0.25))
    ids = [str(c.id) for c in result.conversations]
    code = [i for i, x in enumerate(ids) if x.startswith("stdlib:")]
    assert len(ids) == 40 and len(code) == 10
    assert code[0] < 10 and code[-1] > 30  # interleaved, not appended
    notes = result.report.notes
    assert notes["sharegpt_prompts"] == 30 and notes["code_prompts"] == 10
    assert all(len(c.turns[-1].content) <= 2000 for c in result.conversations)
    assert "code_share=0.25" in result.report.source and result.report.records_seen < HELDOUT_SKIP
    assert all(t.role == "user" for c in result.conversations for t in c.turns)


def test_mix_is_prompt_only_and_needs_a_limit():
    with pytest.raises(ValueError, match="precompute.distill"):
        load_conversations(DataConfig(source="mix", limit=4))
    with pytest.raises(ValueError, match="data.limit"):
        DataConfig(source="mix")
    with pytest.raises(ValueError, match="code_share"):
        DataConfig(source="mix", limit=4, code_share=1.5)


def test_mix_refuses_to_reach_the_held_out_split():
    with pytest.raises(ValueError, match="held-out"):
        load_prompts(DataConfig(source="mix", limit=30, code_share=0.0, skip=HELDOUT_SKIP - 10))


def test_code_prompts_are_reproducible_and_no_humaneval_problem():
    a, b = code_prompts(seed=0), code_prompts(seed=0)
    assert a == b and len(a) > 300
    assert len({r["id"] for r in a}) == len(a)
    names = {name for _, name, _, _ in documented_functions()}
    humaneval = set()
    for it in load_humaneval():
        humaneval |= set(re.findall(r"def (\w+)\(", it.turns[0]))
    assert len(humaneval) >= 150
    assert not names & humaneval, sorted(names & humaneval)[:5]
