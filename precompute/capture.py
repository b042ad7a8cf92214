"""Training records from the target's own generation: tokens, loss mask and the hidden states
the engine captured while it generated them (inference_eval/engine/capture.py).

Self-distillation used to run the target twice: once to answer, once more (precompute) over
prompt + answer only to read states the generation had already computed. Here a record is
built from what the last answered turn's request processed, x_0..x_{L-1} = its prompt ids +
its generated ids, with the states of every one of those rows:

| tokens                     | loss_mask                                          |
|----------------------------|----------------------------------------------------|
| prompt ids (template, user | 1 on earlier assistant turns (multi-turn, the same |
| turns, earlier answers)    | spans chat_template.py masks), 0 elsewhere         |
| generated ids (answer, and | 1: the target's own answer, end-of-turn token      |
| its end-of-turn token)     | included when the target emitted it                |

The record's ids are the tokens the target actually read and wrote, not a re-tokenization of
the answer's text (which may split differently), so the states belong to exactly these ids.
Records are cut to data.max_length and rejected by the same rules as precompute's
(validate.check_tokenized: "too_short").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from precompute.data import Rejected, TokenizedRecord, check_tokenized
from precompute.data.chat_template import _mask_from_offsets, assistant_char_spans
from precompute.dump import STORE_DTYPES
from precompute.shard_io import Shard, quantize_fp8


@dataclass
class CapturedRecord:
    """record: ids and loss mask [T]; hidden [T, H] and aux [T, A, H] or None in the capture
    dtype (capture_dtype)."""

    record: TokenizedRecord
    hidden: torch.Tensor
    aux: torch.Tensor | None = None


def capture_dtype(hidden_dtype: str) -> torch.dtype:
    """The dtype rows are kept in while generating: the stored one, fp32 under fp8 (quantized
    per shard with per-token scales, as precompute/dump.py does)."""
    return torch.float32 if hidden_dtype == "fp8" else STORE_DTYPES[hidden_dtype]


def captured_record(tok, rid: str, messages: list[dict], result, max_length: int
                    ) -> CapturedRecord | Rejected:
    """One record from the GenerationResult `result` of the prompt `messages` (the chat up to
    the last answered user turn). Returns the record or the reason it is rejected."""
    if result.hidden is None:
        raise RuntimeError(f"record {rid}: the engine captured no hidden states; build the "
                           "LLMEngine with capture=CaptureSpec(...)")
    prompt, answer = list(result.prompt_ids), list(result.token_ids)
    ids = prompt + answer
    if result.hidden.shape[0] != len(ids):
        raise RuntimeError(f"record {rid}: {result.hidden.shape[0]} captured rows for "
                           f"{len(ids)} tokens")
    mask = prompt_mask(tok, rid, messages, prompt) + [1] * len(answer)
    cut = max(0, len(ids) - max_length)
    record = TokenizedRecord(rid, ids[:max_length], mask[:max_length], truncated_tokens=cut)
    problem = check_tokenized(record, max_length)
    if problem is not None:
        return problem
    aux = None if result.aux is None else result.aux[:max_length]
    return CapturedRecord(record, result.hidden[:max_length], aux)


def prompt_mask(tok, rid: str, messages: list[dict], prompt_ids: list[int]) -> list[int]:
    """Loss mask over a prompt: 1 on the assistant turns it holds (earlier answers of a
    multi-turn chat), 0 elsewhere. The spans come from the same rules as precompute's masks;
    where the prompt's ids are not one tokenization of its render (a template that tokenizes
    otherwise), the earlier answers are left out of the loss rather than misplaced."""
    if not any(m["role"] == "assistant" for m in messages):
        return [0] * len(prompt_ids)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(prompt_ids):
        return [0] * len(prompt_ids)
    history = messages[:max(i for i, m in enumerate(messages) if m["role"] == "assistant") + 1]
    spans = assistant_char_spans(tok, history, text, record_id=rid)
    return _mask_from_offsets([tuple(o) for o in enc["offset_mapping"]], spans)


def captured_shard(records: Sequence[CapturedRecord], hidden_dtype: str) -> Shard:
    """Records -> one Shard (the tensors precompute/dump.build_shard returns, same casts)."""
    lengths = [len(c.record.input_ids) for c in records]
    cu = torch.zeros(len(records) + 1, dtype=torch.int64)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    hidden = torch.cat([c.hidden for c in records])
    aux = torch.cat([c.aux for c in records]) if records[0].aux is not None else None
    scale = None
    if hidden_dtype == "fp8":
        hidden, scale = quantize_fp8(hidden)
        if aux is not None:  # as in dump.py: aux layers keep bf16 under fp8
            aux = aux.to(torch.bfloat16)
    return Shard(
        input_ids=torch.tensor([t for c in records for t in c.record.input_ids], dtype=torch.int32),
        loss_mask=torch.tensor([m for c in records for m in c.record.loss_mask], dtype=torch.uint8),
        hidden=hidden, cu_seqlens=cu, aux_hidden=aux, hidden_scale=scale,
        record_ids=[c.record.id for c in records])


def split_by_tokens(records: Sequence[CapturedRecord], shard_tokens: int
                    ) -> list[list[CapturedRecord]]:
    """Consecutive groups of at most shard_tokens tokens (a longer record stands alone)."""
    from precompute.plan import plan_shards

    groups = plan_shards([len(c.record.input_ids) for c in records], shard_tokens)
    return [[records[i] for i in g] for g in groups]
