"""The corpus of lookup drafting: the answer tokens of precompute shard directories, as an
`NgramTable` (inference_eval/engine/speculative/lookup.py). Only `input_ids`, `loss_mask` and
`cu_seqlens` are read from each shard (safetensors, lazily: the hidden states stay on disk)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from inference_eval.engine.speculative.lookup import NgramTable
from precompute.identity import tokenizer_identity
from precompute.manifest import Manifest


def corpus_manifests(shard_dirs: str) -> list[tuple[Path, Manifest]]:
    """shard_dirs ('a' or 'a,b') -> each dir with its manifest; an error names the key, the
    directory and the fix (the eval calls this before any run starts)."""
    dirs = [Path(d.strip()) for d in str(shard_dirs).split(",") if d.strip()]
    if not dirs:
        raise ValueError(f"draft.lookup_corpus={shard_dirs!r} names no shard directory")
    out = []
    for d in dirs:
        try:
            out.append((d, Manifest.load(d / "manifest.json")))
        except (FileNotFoundError, ValueError) as exc:
            raise ValueError(f"draft.lookup_corpus: {exc}; point it at precompute output_dirs "
                             "(their shards' answer tokens are the corpus)") from None
    return out


def load_lookup_table(shard_dirs: str, tokenizer=None) -> NgramTable:
    """shard_dirs: one precompute output_dir or several ('a,b'). Each sequence counts its
    n-grams followed by an answer token (loss mask 1). With `tokenizer`, refuse shards
    tokenized by another vocabulary (their ids would draft garbage)."""
    from safetensors import safe_open

    want = None if tokenizer is None else tokenizer_identity(tokenizer).get("vocab_sha256")
    seqs, masks = [], []
    for d, man in corpus_manifests(shard_dirs):
        have = man.tokenizer.get("vocab_sha256")
        if want and have and want != have:
            raise ValueError(f"draft.lookup_corpus: {d} was tokenized with another vocabulary "
                             f"(vocab_sha256 {have[:12]} != the target's {want[:12]}); use shards "
                             "precomputed for this target")
        for e in man.shards:
            path = d / e.file
            if not path.is_file():
                raise FileNotFoundError(f"draft.lookup_corpus: shard {path} is missing; rerun "
                                        "precompute to resume it")
            with safe_open(str(path), framework="np") as f:
                ids, mask, cu = f.get_tensor("input_ids"), f.get_tensor("loss_mask"), f.get_tensor("cu_seqlens")
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
                seqs.append(ids[a:b].astype(np.int64))
                masks.append(mask[a:b].astype(bool))
    if not seqs:
        raise ValueError(f"draft.lookup_corpus={shard_dirs!r}: the shards hold no sequences")
    return NgramTable.build(seqs, masks)
