"""What identifies a shard plan: the tokenizer, the tokenized records and the settings.

`shard_plan_hash` digests everything that determines the shards' bytes; the manifest and every
progress file carry it, so a resume never mixes shards of two plans (precompute/resume.py).
"""
from __future__ import annotations

import hashlib
import json
from array import array
from typing import Any, Iterable, Sequence

from precompute.config import PrecomputeConfig
from precompute.data import TokenizedRecord
from precompute.plan import plan_hash


def tokenizer_identity(tok) -> dict:
    """Class, vocabulary size and sha256s of the vocabulary and the chat template."""
    vocab = json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode()
    template = (tok.chat_template or "").encode()
    return {"class": type(tok).__name__, "vocab_size": len(tok),
            "vocab_sha256": hashlib.sha256(vocab).hexdigest(),
            "chat_template_sha256": hashlib.sha256(template).hexdigest()}


def records_sha256(records: Iterable[TokenizedRecord]) -> str:
    """Digest of every record's ids, tokens and loss mask: same lengths but other text is
    another plan, so a resume never mixes shards of two datasets."""
    h = hashlib.sha256()
    for r in records:
        h.update(r.id.encode() + b"\0")
        h.update(array("q", r.input_ids).tobytes())
        h.update(bytes(r.loss_mask))
    return h.hexdigest()


def shard_plan_hash(cfg: PrecomputeConfig, target_identity: dict[str, Any], tok_id: dict,
                    records: Sequence[TokenizedRecord], aux_layers: list[int]) -> str:
    """sha256 of the target weights, tokenizer, records and the settings that shape shards."""
    return plan_hash({"target": target_identity["weights_sha256"], "tok": tok_id,
                      "records": records_sha256(records), "shard_tokens": cfg.shard_tokens,
                      "batch_tokens": cfg.batch_tokens, "hidden_dtype": cfg.hidden_dtype,
                      "aux": aux_layers, "dtype": cfg.target.dtype})
