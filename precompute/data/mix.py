"""The default prompt mix for self-distillation on the embedded target: ShareGPT's first user
turns (chat; about a quarter of them already ask for code) plus programming requests built from
Python's own documentation (precompute/data/code_prompts.py), `code_share` of the prompts.

Neither source is an evaluation set: ShareGPT records are read from `skip` up to HELDOUT_SKIP
only (the held-out split starts there), and the code prompts are not HumanEval problems. The
two are interleaved evenly, so any `limit` keeps the same share. Prompt-only: the target's
answers (precompute.distill) become the training conversations.

ShareGPT first turns longer than MAX_PROMPT_CHARS (pasted documents and code files, ~5% of
them) are passed over: on a CPU one such prompt in a batch makes every decode step attend
thousands of keys (it tripled the distillation's time per batch, measured), and a small chat
model is rarely sent them.
"""
from __future__ import annotations

from .code_prompts import code_prompts
from .config import HELDOUT_SKIP
from .records import LoadReport, LoadResult
from .sharegpt import load_sharegpt
from .validate import collect


MAX_PROMPT_CHARS = 2000


def load_mix(limit: int, code_share: float, skip: int = 0) -> LoadResult:
    """limit: prompts in all. Returns prompt records (user turns only); the report's source
    names the mix and its notes count each part."""
    code = code_prompts()
    n_code = min(len(code), round(limit * code_share))
    n_chat = limit - n_code
    # Read a margin beyond n_chat: the long prompts passed over are replaced by later records.
    chat = load_sharegpt(skip=skip, limit=n_chat + n_chat // 4 + 8, prompts=True)
    short = [c for c in chat.conversations if len(c.turns[-1].content) <= MAX_PROMPT_CHARS]
    long_skipped = len(chat.conversations) - len(short)
    chat.conversations = short[:n_chat]
    if chat.report.records_seen > HELDOUT_SKIP:
        raise ValueError(f"data=mix: {n_chat} ShareGPT prompts from record {skip} reach into the "
                         f"held-out split (records >= {HELDOUT_SKIP}); lower data.limit")
    report = LoadReport(source=f"mix(sharegpt={chat.report.source}, code=python-stdlib-docs, "
                               f"code_share={code_share})")
    coded = collect(enumerate(code[:n_code]), source_name="python-stdlib-docs", report=report,
                    prompts=True)
    convs, every = [], max(1, round(len(chat.conversations) / max(1, len(coded.conversations))))
    it = iter(coded.conversations)
    for i, conv in enumerate(chat.conversations):
        convs.append(conv)
        if i % every == every - 1:
            nxt = next(it, None)
            if nxt is not None:
                convs.append(nxt)
    convs += list(it)
    report.kept = len(convs)
    report.records_seen += chat.report.records_seen
    for reason, n in chat.report.rejected.items():
        report.rejected[reason] = report.rejected.get(reason, 0) + n
    report.notes.update({"sharegpt_prompts": len(chat.conversations),
                         "code_prompts": len(coded.conversations),
                         "long_prompts_passed_over": long_skipped})
    return LoadResult(convs, chat.rejected + coded.rejected, report)
