"""Block drafters in the chain engine (DFlash: one non-causal block pass; P-EAGLE: one pass of
mask steps): each round's drafts are the training forward's for the same prefix, greedy and
sampled speculation stay lossless with heads fitted so that drafts are really accepted, and the
engine refuses what a block drafter cannot do."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from heads.batch import PackedBatch
from heads.checkpoint import load_head, save_head
from heads.config import HeadConfig
from heads.registry import build_head
from heads.rollout import rollout
from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionBackend
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.sampling import SamplingParams, SamplingTensors, processed_probs
from inference_eval.engine.speculative.block_drafters import BlockContextDrafter, ParallelHeadDrafter
from inference_eval.evaluation.engines import build_engine, frozen_parts_of
from engine_cases import load_tiny, random_prompts
from spec_stats import chi2_pvalue
from fit_head import train_steps

CFG = dict(attention="torch", page_size=4)
AUX = [0, 1, 2]
KINDS = {"dflash": dict(type="dflash", num_steps=3, num_layers=2),
         "peagle": dict(type="eagle3", num_steps=3, parallel_drafting=True),
         # a fused first layer, then a plain decoder layer with its own keys and values
         "peagle_2layers": dict(type="eagle3", num_steps=3, parallel_drafting=True, num_layers=2),
         # with the transition bias (heads/transition.py): d_k's law depends on d_{k-1}
         "dflash_markov": dict(type="dflash", num_steps=3, num_layers=2, markov_rank=8),
         "peagle_markov": dict(type="eagle3", num_steps=3, parallel_drafting=True, markov_rank=8),
         # DSpark: d_1 biased from the block's anchor too, and the confidence head
         "dspark": dict(type="dflash", num_steps=3, num_layers=2, markov_rank=8,
                        markov_first=True, confidence_head=True)}


@pytest.fixture(scope="module")
def loaded(tiny_hf):
    return load_tiny(tiny_hf)


def _states(loaded, ids: list[int], lens: list[int] | None = None):
    """The target's (hidden [N, H], aux [N, A, H]) of packed sequences, as precompute stores them."""
    lens = lens or [len(ids)]
    out = loaded.model(torch.tensor(ids), TorchAttentionBackend().plan(BatchLayout.packed(lens)),
                       None, compute_logits=False, aux_layers=AUX)
    return out.hidden.float(), out.aux.float()


def fit_block_head(loaded, seqs: list[list[int]], kind: str, steps: int = 60, lr: float = 3e-3):
    """A block head fitted in seconds on `seqs` (prompt + the target's continuation), every
    position a label, so the engine's drafts are accepted far above chance."""
    ids = [t for s in seqs for t in s]
    lens = [len(s) for s in seqs]
    with torch.no_grad():
        hidden, aux = _states(loaded, ids, lens)
    head = build_head(HeadConfig(**KINDS[kind], aux_layers=AUX, anchors_per_seq=1000),
                      frozen_parts_of(loaded), seed=0)
    batch = PackedBatch(torch.tensor(ids), hidden, torch.ones(len(ids), dtype=torch.bool), lens, aux)
    return train_steps(head, batch, steps, lr, seed=0).eval()


def _ar(loaded, prompts, params):
    eng = LLMEngine(loaded.model, None, EngineConfig(**CFG))
    return [r.token_ids for r in eng.generate(prompts, params, progress=False)]


def _engine(loaded, path, k=3, conf=0.0, **cfg):
    return build_engine(loaded, EngineConfig(**CFG, **cfg), SimpleNamespace(
        kind="head", checkpoint=str(path), num_draft=k, scheme="chain", min_confidence=conf))


def _tree(loaded, path, depth=3, topk=2, total=6, **cfg):
    return build_engine(loaded, EngineConfig(**CFG, **cfg), SimpleNamespace(
        kind="head", checkpoint=str(path), scheme="tree", depth=depth, topk=topk,
        total_tokens=total))


def _trained_laws(loaded, head, token_ids: list[int], prev: list[int] | None = None
                  ) -> torch.Tensor:
    """[K, V]: the training forward's laws of the drafts after `token_ids` (its last token
    x_n has no target state yet), in the target vocabulary; with the transition bias, law
    k >= 2 after the drafts prev[k - 2] (d_1..d_{K-1}; None: the pass's laws alone), and
    with markov_first law 1 after the anchor x_n."""
    n = len(token_ids)
    hidden, aux = _states(loaded, token_ids)
    ids = torch.tensor(token_ids)
    with torch.no_grad():
        if head.drafting == "block":  # the block anchored at x_n
            feats = head.train_blocks(aux, [n], ids, torch.tensor([n - 1]))[0, 1:]
        else:  # steps 1..K of the rollout at t = n - 2 (step 1 reads h_{n-2} and x_{n-1})
            outs = rollout(head, PackedBatch(ids, hidden, torch.ones(n, dtype=torch.bool), [n], aux))
            feats = torch.stack([o.features[n - 2] for o in outs])
        laws = head.logits(feats).float()
        if prev is not None and head.transition is not None:
            laws[1:] += head.transition(torch.tensor(prev[:laws.shape[0] - 1]))
        if head.cfg.markov_first:  # d_1's bias, read from the anchor x_n
            laws[:1] += head.transition(ids[-1:])
        return laws


def _trained_confidence(loaded, head, token_ids: list[int], drafts: list[int]) -> torch.Tensor:
    """[K]: the confidence head's predicted acceptance of the drafts of the block anchored at
    x_n in the training forward, each after the token before it (x_n, then d_1, d_2, ...)."""
    n = len(token_ids)
    _, aux = _states(loaded, token_ids)
    with torch.no_grad():
        feats = head.train_blocks(aux, [n], torch.tensor(token_ids), torch.tensor([n - 1]))[0, 1:]
        prev = torch.tensor([token_ids[-1], *drafts])[:feats.shape[0]]
        return torch.sigmoid(head.confidence_logit(feats, prev).float())


@pytest.mark.parametrize("kind", list(KINDS))
def test_engine_drafts_are_the_training_forwards(loaded, tmp_path, kind):
    """After the prefill and after each round, the K laws one round drafts from equal the
    training forward's (train_blocks / rollout) on the request's tokens so far."""
    head = build_head(HeadConfig(**KINDS[kind], aux_layers=AUX), frozen_parts_of(loaded), seed=4)
    with torch.no_grad():  # trained-looking weights: laws that depend on every input
        for p in head.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    save_head(head, tmp_path / "h")
    eng = _engine(loaded, tmp_path / "h", head_code="none")
    assert isinstance(eng.drafter, BlockContextDrafter if head.drafting == "block" else ParallelHeadDrafter)
    req = eng.add_request(random_prompts(1, 5, 20)[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    for _ in range(4):  # the prefill, then three rounds
        eng.step()
        n = [req.num_cached]
        assert eng.drafter.draft_lengths([req], n, [3]) == [3]
        state, laws = eng.drafter.begin_round([req], n)
        drafts, conf = [], [eng.drafter.confidence()]
        for s in (1, 2):  # d_s: the law's argmax, as greedy drafting draws it
            drafts.append(int(laws[-1].argmax()))
            laws = torch.cat([laws, eng.drafter.step([req], n, s, torch.tensor(drafts[-1:]),
                                                     state)[1]])
            conf.append(eng.drafter.confidence())
        want = _trained_laws(loaded, head, req.token_ids, drafts)
        torch.testing.assert_close(laws, want, rtol=1e-4, atol=1e-4)
        if getattr(head, "confidence", None) is None:
            assert conf == [None] * 3  # the cut reads the laws' top probabilities
        else:
            torch.testing.assert_close(torch.cat(conf), _trained_confidence(
                loaded, head, req.token_ids, drafts), rtol=1e-4, atol=1e-5)
        if head.transition is not None:  # the bias is in the laws: without it they differ
            assert (want - _trained_laws(loaded, head, req.token_ids))[1:].abs().max() > 1e-2
    assert sum(req.proposed) > 0


@pytest.fixture(scope="module")
def fitted(loaded, tmp_path_factory):
    """kind -> (checkpoint dir, prompts, AR outputs, median confidence): heads fitted on the
    first 12 tokens of the target's greedy answers to these prompts. The tiny random target's
    laws are nearly flat (top probabilities ~0.01 over 320 tokens), so a confidence cut sits
    at the median of the head's own top probabilities of d_1."""
    prompts = random_prompts(4, 13, 20, bos=None)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    ar = _ar(loaded, prompts, params)
    out = {}
    for kind in KINDS:
        head = fit_block_head(loaded, [p + a[:12] for p, a in zip(prompts, ar)], kind)
        path = tmp_path_factory.mktemp(kind)
        save_head(head, path)
        # d_1's: the draft the cut gates a round's drafting on
        tops = [torch.softmax(_trained_laws(loaded, head, p + a[:i])[0], -1).max()
                for p, a in zip(prompts, ar) for i in (2, 8, 14)]
        out[kind] = (path, prompts, ar, float(torch.stack(tops).median()))
    return out


@pytest.mark.parametrize("cut", [False, True])
@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_is_lossless_with_accepted_drafts(loaded, fitted, kind, cut):
    """Batched, with per-request lengths (K shrinks near max_new_tokens), with and without
    the confidence cut: the autoregressive output, and drafts past the first accepted."""
    path, prompts, _, median = fitted[kind]
    conf = median if cut else 0.0
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (24, 9, 17, 5)]
    out = _engine(loaded, path, conf=conf).generate(prompts, params, progress=False)
    assert [r.token_ids for r in out] == _ar(loaded, prompts, params)
    rounds = [(p, a) for r in out for p, a in zip(r.meta["proposed"][1:], r.meta["accepted"][1:])]
    accepted = sum(a for _, a in rounds)
    drafting = [p for p, _ in rounds if p]  # the rounds the cut let draft
    assert accepted > len(drafting) // 2  # really accepted (a random head: ~0)
    assert any(a >= 2 for _, a in rounds)  # deeper drafts of a block accepted too
    assert max(p for p, _ in rounds) <= 3
    if conf > 0:
        assert min(p for p, _ in rounds) < 3  # the cut ran


@torch.no_grad()
def _joint_first_three(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """[V, V, V] fp64: the target's exact law of the first three generated tokens."""
    st, be, v = SamplingTensors.from_params([params]), TorchAttentionBackend(), model.arch.vocab_size

    def law(ids):
        lg = model(torch.tensor(ids), be.plan(BatchLayout.packed([len(ids)]))).logits[-1:]
        return processed_probs(lg, st)[0].double()

    joint = torch.zeros(v, v, v, dtype=torch.float64)
    p1 = law(prompt)
    for a in p1.nonzero().flatten().tolist():
        p2 = law(prompt + [a])
        for b in p2.nonzero().flatten().tolist():
            joint[a, b] = p1[a] * p2[b] * law(prompt + [a, b])
    return joint


def _sampled_first_three(loaded, eng, prompt, trials: int = 3000):
    """Temperature 0.8, top-k 4: `trials` generations of 4 tokens; asserts that the joint law
    of the first three is the target's and that the first round accepted both of two drafts
    in some trials and none in others -> the outputs."""
    params = SamplingParams(temperature=0.8, top_k=4, max_new_tokens=4, ignore_eos=True)
    joint = _joint_first_three(loaded.model, prompt, params)
    out = eng.generate([prompt] * trials, params, progress=False)
    counts = torch.zeros_like(joint)
    for r in out:
        counts[tuple(r.token_ids[:3])] += 1
    first_round = [r.meta["accepted"][1] for r in out]
    assert 0 < first_round.count(2) < trials and 0 < first_round.count(0)
    assert chi2_pvalue(counts, joint) > 1e-4
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_sampled_is_lossless_with_accepted_block_drafts(loaded, fitted, kind):
    """Temperature 0.8, top-k 4, K = 2: the first round after the prefill drafts d_1 and d_2
    from one pass (d_2's law sees d_1 only through the transition bias, if any); the joint law of the first three tokens is the
    target's, and both drafts were accepted in some rounds and rejected in others."""
    path, prompts, _, _ = fitted[kind]
    out = _sampled_first_three(loaded, _engine(loaded, path, k=2, max_batch_size=4096, seed=11),
                               prompts[0])
    assert all(r.meta["proposed"][1] == 2 for r in out)


@pytest.mark.parametrize("bias, drafts", [(-30.0, False), (30.0, True)])
def test_the_cut_reads_the_confidence_head(loaded, fitted, bias, drafts):
    """With a confidence head the cut reads its predicted acceptance, not the laws: a head
    that predicts none drafts nothing at a threshold half the laws' top probabilities pass
    (a quarter of their median), one that predicts certain acceptance drafts every round at
    a threshold above every law's top probability."""
    path, prompts, ar, median = fitted["dspark"]
    head = load_head(path, frozen_parts_of(loaded))
    with torch.no_grad():
        head.confidence.bias.fill_(bias)
    save_head(head, path.parent / f"conf{bias}")
    eng = _engine(loaded, path.parent / f"conf{bias}", conf=median / 4 if not drafts else 0.999)
    out = eng.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True), progress=False)
    assert [r.token_ids for r in out] == ar
    proposed = sum(sum(r.meta["proposed"]) for r in out)
    assert (proposed > 0) == drafts
    if drafts:  # all 3 drafts in every round but those near max_new_tokens
        rounds = [p for r in out for p in r.meta["proposed"][1:]]
        assert sum(p == 3 for p in rounds) >= 0.75 * len(rounds)


def test_peagle_pass_waits_for_the_cut_of_d1(loaded, fitted, monkeypatch):
    """P-EAGLE's d_1 comes from the refill, so its mask pass runs only in the rounds whose
    d_1 the cut keeps (and that may draft more than one): one prompt at a time, the passes
    are exactly those rounds, each of K - 1 rows, and the output is the autoregressive one."""
    path, prompts, ar, median = fitted["peagle"]
    calls = []
    real = ParallelHeadDrafter._mask_pass
    monkeypatch.setattr(ParallelHeadDrafter, "_mask_pass",
                        lambda self, rows, plan: calls.append(rows) or real(self, rows, plan))
    eng, new = _engine(loaded, path, conf=median), 24
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    cut_rounds = 0
    for prompt, want in zip(prompts, ar):
        calls.clear()
        r = eng.generate([prompt], params, progress=False)[0]
        assert r.token_ids == want
        made, passes = 1, []  # tokens out before the round (the prefill's first)
        for proposed, accepted in zip(r.meta["proposed"][1:], r.meta["accepted"][1:]):
            k = min(3, new - made - 1)  # the round's draft length
            if proposed >= 1 and k > 1:
                passes.append(k - 1)
            cut_rounds += proposed == 0 and k > 1
            made += accepted + 1
        assert calls == passes
    assert cut_rounds > 0  # rounds that paid no pass


def test_refusals(loaded, fitted):
    path, prompts, _, _ = fitted["dflash"]
    with pytest.raises(ValueError, match="num_draft=4 is more than the 3"):
        _engine(loaded, path, k=4)
    with pytest.raises(ValueError, match="draft.depth=4 is more than the 3"):
        _tree(loaded, path, depth=4)
    with pytest.raises(ValueError, match="sync_free"):
        build_engine(loaded, EngineConfig(**CFG), SimpleNamespace(
            kind="head", checkpoint=str(path), num_draft=3, scheme="chain", sync_free=True))
    # A short block: K = 1 drafts one token per round through the same block pass.
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    out = _engine(loaded, path, k=1).generate(prompts[:2], params, progress=False)
    assert [r.token_ids for r in out] == _ar(loaded, prompts[:2], params)
    assert max(max(r.meta["proposed"]) for r in out) == 1


def test_block_drafter_behind_lookup_keeps_its_lengths(loaded, fitted):
    """draft.lookup: the lookup drafter asks the block drafter for its rows' lengths too."""
    path, prompts, _, _ = fitted["dflash"]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    eng = build_engine(loaded, EngineConfig(**CFG), SimpleNamespace(
        kind="head", checkpoint=str(path), num_draft=3, scheme="chain", lookup=True,
        lookup_min_match=2, lookup_max_match=4, model_draft=None))
    out = eng.generate(prompts, params, progress=False)
    assert [r.token_ids for r in out] == _ar(loaded, prompts, params)


@pytest.mark.parametrize("kind", list(KINDS))
def test_block_tree_is_the_per_position_top_k(loaded, fitted, kind):
    """draft.scheme=tree over a block drafter: after the prefill and each round, every node of
    depth d of the round's tree is among the top-k of the training forward's law of d_d (its
    parent changes that law only through the transition bias, from the parent's token), and
    depth 1 holds exactly that top-k."""
    path, prompts, _, _ = fitted[kind]
    eng = _tree(loaded, path, depth=3, topk=2, total=5)
    req = eng.add_request(prompts[0], SamplingParams(max_new_tokens=30, ignore_eos=True))
    for _ in range(4):
        eng.step()
        n = [req.num_cached]
        ks = eng.drafter.draft_lengths([req], n, [3])
        tree = eng._build([req], ks, n)
        valid = tree.valid[0].nonzero().flatten()[1:].tolist()  # the root excluded
        depth, tok, par = tree.depth[0].tolist(), tree.tokens[0].tolist(), tree.parents[0].tolist()

        def top(i):  # the top-2 of node i's law: after its parent's token (the bias, if any)
            prev = [tok[par[i]]] * 2 if depth[i] >= 2 else None
            laws = _trained_laws(loaded, eng.drafter.head, req.token_ids, prev)
            return laws[depth[i] - 1].topk(2).indices.tolist()

        assert sorted(tok[i] for i in valid if depth[i] == 1) == sorted(top(valid[0]))
        assert all(tok[i] in top(i) for i in valid)
        assert max(depth[i] for i in valid) >= 2


@pytest.mark.parametrize("kind", list(KINDS))
def test_block_tree_greedy_is_lossless_and_accepts_more(loaded, fitted, kind):
    """Batched, per-request lengths: the tree's output is the autoregressive one, its drafts
    are accepted, deeper than one node, and a top-2 tree accepts at least what the chain of the
    same drafter does."""
    path, prompts, _, _ = fitted[kind]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (24, 9, 17, 5)]
    out = _tree(loaded, path).generate(prompts, params, progress=False)
    assert [r.token_ids for r in out] == _ar(loaded, prompts, params)
    acc = [a for r in out for a in r.meta["accepted"][1:]]
    chain = [a for r in _engine(loaded, path).generate(prompts, params, progress=False)
             for a in r.meta["accepted"][1:]]
    assert max(acc) >= 2 and sum(acc) / len(acc) >= sum(chain) / len(chain)


@pytest.mark.parametrize("kind", list(KINDS))
def test_block_tree_sampled_is_lossless(loaded, fitted, kind):
    """Temperature 0.8, top-k 4, a depth-2 top-2 tree: the joint law of the first three tokens
    is the target's, and the first round's tree is accepted to depth 2 in some trials."""
    path, prompts, _, _ = fitted[kind]
    _sampled_first_three(loaded, _tree(loaded, path, depth=2, topk=2, total=4,
                                       max_batch_size=4096, seed=12), prompts[0])
