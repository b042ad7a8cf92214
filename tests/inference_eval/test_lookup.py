"""Lookup drafting: the corpus n-gram table and the context index against plain counting and
scanning references; the lookup drafter alone and in front of a head, an LLM and Medusa
heads stays lossless and has its drafts accepted; the corpus is read from shard dirs."""
from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from inference_eval.engine.config import EngineConfig
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.speculative.lookup import ContextIndex, NgramTable, lookup_chain, ngram_hash
from inference_eval.engine.speculative.lookup_drafter import LookupDrafter
from inference_eval.evaluation.config import DraftConfig
from inference_eval.evaluation.engines import build_engine
from inference_eval.evaluation.lookup_corpus import corpus_manifests, load_lookup_table
from tests.inference_eval.test_drafters import CFG, _ar, _drafter_cfg, _loaded, _prompts
from tests.spec_stats import chi2_pvalue, first_two_counts, joint_first_two


def _motif_corpus(seed=0, n_seq=30):
    """Sequences that reuse a few motifs, so n-grams repeat with (mostly) one continuation."""
    g = np.random.default_rng(seed)
    motifs = [g.integers(0, 12, size=int(g.integers(3, 7))) for _ in range(5)]
    seqs = []
    for _ in range(n_seq):
        parts = [motifs[i] if g.random() < 0.8 else g.integers(0, 12, size=3)
                 for i in g.integers(0, 5, size=int(g.integers(2, 6)))]
        seqs.append(np.concatenate(parts))
    return seqs


def _majority_reference(seqs, masks, n, min_count, min_share):
    follow: dict[tuple, Counter] = {}
    for s, m in zip(seqs, masks):
        for i in range(n, len(s)):
            if m[i]:
                follow.setdefault(tuple(s[i - n:i].tolist()), Counter())[int(s[i])] += 1
    out = {}
    for key, c in follow.items():
        best = max(c.values())
        tok = min(t for t, v in c.items() if v == best)
        if best >= min_count and best > min_share * sum(c.values()):
            out[key] = tok
    return out


@pytest.mark.parametrize("min_count,min_share", [(2, 0.5), (1, 0.0), (3, 0.7)])
def test_ngram_table_is_the_majority_continuation(min_count, min_share):
    seqs = _motif_corpus()
    g = np.random.default_rng(1)
    masks = [g.random(len(s)) < 0.7 for s in seqs]  # only answer tokens may be proposed
    table = NgramTable.build(seqs, masks, min_n=1, max_n=4, min_count=min_count, min_share=min_share)
    total = 0
    refs = {n: _majority_reference(seqs, masks, n, min_count, min_share) for n in range(1, 5)}
    for n in range(1, 5):
        ref = refs[n]
        got = table.tables[n - 1]
        assert {k: got.get(ngram_hash(k)) for k in ref} == ref
        assert len(got) == len(ref)  # nothing the reference drops
        total += len(ref)
    assert total == len(table) > 20
    # next_token takes the longest suffix the table knows.
    for s in seqs[:10]:
        for i in range(1, len(s)):
            prefix = s[:i].tolist()
            want = None
            for n in range(min(4, i), 0, -1):
                want = refs[n].get(tuple(prefix[-n:]))
                if want is not None:
                    break
            assert table.next_token(prefix) == want


def _scan_reference(tokens, indexed, min_n, max_n):
    """The token after the latest earlier occurrence (within the indexed tokens, its follower
    indexed too) of the longest suffix of `tokens`."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suf = tokens[len(tokens) - n:]
        for j in range(indexed - n - 1, -1, -1):
            if tokens[j:j + n] == suf:
                return tokens[j + n]
    return None


def test_context_index_matches_a_backward_scan():
    g = np.random.default_rng(2)
    tokens = [int(t) for t in np.concatenate([g.integers(0, 6, size=8)] * 3 + [g.integers(0, 6, size=20)])]
    ctx = ContextIndex(min_n=2, max_n=5)
    hits = 0
    for i in range(1, len(tokens) + 1):
        ctx.sync(tokens[:i])  # grows one token at a time, as a request does
        got = ctx.next_token(tokens[:i])
        assert got == _scan_reference(tokens[:i], i, 2, 5)
        hits += got is not None
        # With drafts after the indexed tokens the suffix reads them, the match stays indexed.
        drafted = tokens[:i] + [int(g.integers(0, 6))]
        assert ctx.next_token(drafted) == _scan_reference(drafted, i, 2, 5)
    assert hits > 10


def test_lookup_chain_copies_context_then_falls_back_to_the_table():
    ctx = ContextIndex(min_n=2, max_n=4)
    ctx.sync([5, 6, 7, 8, 1, 5, 6])
    # Context: "5 6" was followed by 7, then "6 7" by 8, then "7 8" by 1; then "8 1" is unknown.
    assert lookup_chain(ctx, None, 5) == [7, 8, 1, 5, 6]
    ctx2 = ContextIndex(min_n=2, max_n=4)
    ctx2.sync([9, 5, 6])
    table = NgramTable.build([np.array([5, 6, 3, 4]), np.array([5, 6, 3, 4])], min_n=2, max_n=3)
    assert lookup_chain(ctx2, table, 4) == [3, 4]  # the corpus knows "5 6" -> 3 -> 4, then stops
    assert lookup_chain(ctx2, None, 4) == []


def _oracle_table(loaded, prompts, params):
    """A corpus holding the target's own greedy continuations: lookup drafts get accepted."""
    outs = _ar(loaded, prompts, params)
    return NgramTable.build([np.array(o) for o in outs], min_n=2, max_n=6, min_count=1)


def test_lookup_alone_is_lossless_and_accepted(tiny_hf):
    loaded = _loaded(tiny_hf)
    prompts = _prompts()
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 14, 20, 5, 17, 12)]
    table = _oracle_table(loaded, prompts[:3], params[:3])  # half the prompts have a corpus
    cfg = DraftConfig(kind="lookup", num_draft=3)
    eng = build_engine(loaded, EngineConfig(**CFG), cfg)
    eng.drafter.table = table
    out = eng.generate(prompts, params, progress=False)
    assert [r.token_ids for r in out] == _ar(loaded, prompts, params)
    for r in out:
        assert len(r.token_ids) == r.meta["target_steps"] + sum(r.meta["accepted"])
        assert max(r.meta["proposed"]) <= 3
    covered = sum(sum(r.meta["accepted"]) for r in out[:3])
    assert covered >= 0.5 * sum(len(r.token_ids) for r in out[:3])  # the oracle corpus pays
    assert eng.counters["lookup_rounds"] > 0


@pytest.mark.parametrize("kind", ["head", "head_sync_free", "llm_other", "medusa"])
def test_lookup_in_front_of_a_model_drafter_is_lossless(tiny_hf, tmp_path, kind):
    """Half the prompts' continuations are in the corpus: batches mix lookup rounds and model
    rounds (the model drafts model_draft tokens), greedy output equals autoregressive; a
    sync-free head catches up on lookup rounds' verified rows too."""
    loaded = _loaded(tiny_hf)
    prompts = _prompts()
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 14, 20, 5, 17, 12)]
    base = _drafter_cfg(kind.removesuffix("_sync_free"), loaded, tmp_path, tiny_hf, num_draft=3)
    cfg = SimpleNamespace(**vars(base), lookup=True, lookup_corpus=None, model_draft=2,
                          lookup_min_match=2, lookup_max_match=8,
                          sync_free=kind.endswith("_sync_free"))
    eng = build_engine(loaded, EngineConfig(**CFG), cfg)
    assert isinstance(eng.drafter, LookupDrafter) and eng.drafter.inner is not None
    assert eng.drafter.sync_free == kind.endswith("_sync_free")
    eng.drafter.table = _oracle_table(loaded, prompts[:3], params[:3])
    seen = {"rows": 0, "steps": set()}
    inner_begin, inner_step = eng.drafter.inner.begin_round, eng.drafter.inner.step

    def counting_begin(reqs, n):
        seen["rows"] += len(reqs)
        return inner_begin(reqs, n)

    def counting_step(reqs, n, s, tokens, state):
        seen["steps"].add(s)
        return inner_step(reqs, n, s, tokens, state)
    eng.drafter.inner.begin_round, eng.drafter.inner.step = counting_begin, counting_step
    out = eng.generate(prompts, params, progress=False)
    assert [r.token_ids for r in out] == _ar(loaded, prompts, params)
    assert eng.counters["lookup_rounds"] > 0 and seen["rows"] > 0
    # The model drafts model_draft = 2 tokens (its begin_round and step s=1), never the
    # round's K = 3, which lookup rounds may use.
    assert seen["steps"] == {1}
    assert max(max(r.meta["proposed"]) for r in out[:3]) == 3
    assert sum(sum(r.meta["accepted"]) for r in out[:3]) > 0


def test_sampled_lookup_matches_target_distribution(tiny_hf):
    """Temperature 0.8, top-k 4: lookup drafts are one-hot logits, so the engine's sampled
    draft is the looked-up token with q one-hot, and the joint law of the first two tokens
    (the second from a speculative round) is the target's exact one. The corpus maps each
    possible first token to the target's likeliest second one: drafts are accepted and rejected."""
    loaded = _loaded(tiny_hf)
    prompt = _prompts(1, seed=9)[0]
    params = SamplingParams(temperature=0.8, top_k=4, max_new_tokens=3, ignore_eos=True)
    joint = joint_first_two(loaded.model, prompt, params)
    firsts = joint.sum(1).nonzero().flatten().tolist()
    corpus = [np.array([a, int(joint[a].argmax())]) for a in firsts] * 2
    eng = build_engine(loaded, EngineConfig(attention="torch", page_size=4, max_batch_size=4096, seed=123),
                       DraftConfig(kind="lookup", num_draft=2))
    eng.drafter.table = NgramTable.build(corpus, min_n=1, max_n=1)
    trials = 3000
    out = eng.generate([prompt] * trials, params, progress=False)
    accepted = sum(r.meta["accepted"][1] for r in out)
    assert 0.2 * trials < accepted < trials  # both branches were exercised
    assert chi2_pvalue(first_two_counts(out, 320), joint) > 1e-4


def test_draft_config_lookup_keys():
    assert DraftConfig(kind="lookup").lookup and DraftConfig(kind="lookup").label == "lookup-chain"
    assert DraftConfig(kind="head", checkpoint="x/mtp", lookup=True).label == "mtp-chain-lookup"
    with pytest.raises(ValueError, match="use scheme=chain"):
        DraftConfig(kind="head", checkpoint="x", lookup=True, scheme="tree")
    with pytest.raises(ValueError, match="model_draft"):
        DraftConfig(kind="head", checkpoint="x", model_draft=2)  # without lookup
    with pytest.raises(ValueError, match="lookup_corpus needs lookup=true"):
        DraftConfig(kind="head", checkpoint="x", lookup_corpus="runs/s")
    with pytest.raises(ValueError, match="lookup_min_match"):
        DraftConfig(kind="lookup", lookup_min_match=3, lookup_max_match=2)
    with pytest.raises(ValueError, match="needs a drafter behind it"):
        DraftConfig(kind="none", lookup=True)


def _write_shards(d, seqs, masks, vocab_sha="v1"):
    from precompute.manifest import Manifest, ShardEntry
    from precompute.shard_io import Shard, write_shard

    d.mkdir()
    ids = torch.tensor(np.concatenate(seqs), dtype=torch.int32)
    cu = torch.tensor(np.cumsum([0] + [len(s) for s in seqs]), dtype=torch.int64)
    shard = Shard(input_ids=ids, loss_mask=torch.tensor(np.concatenate(masks), dtype=torch.uint8),
                  hidden=torch.zeros(len(ids), 4, dtype=torch.bfloat16), cu_seqlens=cu)
    sha = write_shard(d / "shard_00000.safetensors", shard)
    man = Manifest(target={"name": "t"}, tokenizer={"vocab_sha256": vocab_sha}, hidden_dtype="bfloat16",
                   hidden_size=4, aux_layers=[], plan_hash="p", num_planned_shards=1,
                   shards=[ShardEntry("shard_00000.safetensors", sha, len(seqs), len(ids),
                                      int(sum(m.sum() for m in masks)), 0)], complete=True)
    man.save(d / "manifest.json")


def test_corpus_from_shards_counts_answer_tokens_only(tmp_path, monkeypatch):
    prompt, answer = [9, 9, 1, 2], [3, 4, 5]
    seqs = [np.array(prompt + answer)] * 3
    masks = [np.array([0] * 4 + [1] * 3, dtype=bool)] * 3
    _write_shards(tmp_path / "s", seqs, masks)
    table = load_lookup_table(str(tmp_path / "s"))
    assert table.next_token([1, 2]) == 3 and table.next_token([2, 3, 4]) == 5
    assert table.next_token([9, 9]) is None  # "9 9" is followed by a prompt token only
    # Another vocabulary is refused, naming the dir; a missing shard names the file.
    import inference_eval.evaluation.lookup_corpus as lc
    monkeypatch.setattr(lc, "tokenizer_identity", lambda tok: {"vocab_sha256": "other"})
    with pytest.raises(ValueError, match="tokenized with another vocabulary"):
        load_lookup_table(str(tmp_path / "s"), tokenizer=object())
    (tmp_path / "s" / "shard_00000.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="shard_00000.safetensors is missing"):
        load_lookup_table(str(tmp_path / "s"))
    # A dir that is no precompute output names the key and the fix, before any run starts.
    with pytest.raises(ValueError, match=r"draft.lookup_corpus: no manifest at .*nowhere.*"
                                         r"point it at precompute output_dirs"):
        corpus_manifests(f"{tmp_path / 's'},{tmp_path / 'nowhere'}")


def test_eval_checks_the_corpus_before_the_baseline_runs(tmp_path, monkeypatch):
    """python -m inference_eval with a bad draft.lookup_corpus stops before loading the target."""
    import inference_eval.evaluation.evaluate as ev
    from inference_eval.evaluation.config import EvalConfig
    from inference_eval.evaluation.prompts import PromptsConfig

    def no_target(*a, **k):
        raise AssertionError("the target was loaded before the corpus was checked")
    monkeypatch.setattr(ev, "load_target", no_target)
    jl = tmp_path / "p.jsonl"
    jl.write_text(json.dumps({"prompt": "hi"}) + "\n")
    cfg = EvalConfig(prompts=PromptsConfig(name="jsonl", path=str(jl)),
                     drafts=[DraftConfig(kind="lookup", lookup_corpus=str(tmp_path / "none"))])
    with pytest.raises(ValueError, match="draft.lookup_corpus: no manifest"):
        ev.main(cfg)


def test_a_lookup_run_that_never_matches_reports_a_zero_share(tiny_hf):
    loaded = _loaded(tiny_hf)
    eng = build_engine(loaded, EngineConfig(**CFG), SimpleNamespace(
        kind="lookup", num_draft=3, scheme="chain", lookup=True, lookup_corpus=None,
        model_draft=None, lookup_min_match=8, lookup_max_match=8))
    out = eng.generate([[5, 6, 7]], [SamplingParams(max_new_tokens=4, ignore_eos=True)],
                       progress=False)
    assert len(out[0].token_ids) == 4 and eng.counters["lookup_rounds"] == 0
