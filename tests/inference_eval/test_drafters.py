"""The drafter interface: the chain engine runs a head, an LLM and a Medusa drafter through the
same verbs and stays lossless with each while its drafts are accepted (and, but for the
target as its own draft, rejected too); a Medusa head's drafts read the target's feature at
the last accepted position; a round that stops on an EOS counts only the drafts it emitted;
a tree round counts only the depths its pruned tree reached on the verified path."""
from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from heads.checkpoint import save_head
from heads.config import HeadConfig
from heads.registry import build_head
from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionBackend
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.speculative import DraftTree, tree_path_proposed, verify_tree_greedy
from inference_eval.engine.speculative.drafters import Drafter, LLMDrafter, MedusaDrafter
from inference_eval.engine.speculative.spec_engine import SpecEngine
from inference_eval.engine.speculative.tree_engine import TreeSpecEngine
from inference_eval.engine.target import TargetConfig, load_target
from inference_eval.evaluation.engines import build_engine, frozen_parts_of
from inference_eval.evaluation.metrics import TurnOutput, per_position_accept_rate
from engine_cases import load_tiny as _loaded, random_prompts
from fit_head import fit_on_greedy
from tiny_hf_models import perturbed_copy

SPEC = Path(__file__).resolve().parents[2] / "inference_eval" / "engine" / "speculative"
CFG = dict(attention="torch", page_size=4)


def _prompts(k=6, seed=21):
    return random_prompts(k, seed, 30)


def _ar(loaded, prompts, params, eos_ids=None):
    eng = LLMEngine(loaded.model, None, EngineConfig(**CFG))
    if eos_ids is not None:
        eng.eos_ids = eos_ids
    return [r.token_ids for r in eng.generate(prompts, params, progress=False)]


def _medusa(loaded, path, num_steps=3, seed=4):
    """A Medusa checkpoint whose blocks are not the identity (they start at zero)."""
    head = build_head(HeadConfig(type="medusa", num_steps=num_steps), frozen_parts_of(loaded), seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in head.blocks:
            b.weight.copy_(0.3 * torch.randn(b.weight.shape, generator=g))
            b.bias.copy_(0.1 * torch.randn(b.bias.shape, generator=g))
    save_head(head, path)
    return head


_FITTED: dict[tuple[str, str], torch.nn.Module] = {}


def _fitted(loaded, tiny_hf, head_type):
    """An mtp head, or a Medusa head of 3 steps, fitted on the target's greedy continuations
    of _prompts() (once per session): it drafts what the target says often, not always."""
    key = (str(tiny_hf("llama3")[0]), head_type)
    if key not in _FITTED:
        cfg = HeadConfig(type="medusa", num_steps=3) if head_type == "medusa" else None
        _FITTED[key] = fit_on_greedy(loaded, _prompts(), cfg=cfg)
    return _FITTED[key]


def _drafter_cfg(kind, loaded, tmp_path, tiny_hf, num_draft=3):
    """Every drafter but llm_self is right often and wrong sometimes, so lossless runs take
    both the accept and the reject path (a random head or model accepts nothing)."""
    if kind == "llm_self":  # the target as its own draft: every draft is accepted
        return SimpleNamespace(kind="llm", num_draft=num_draft, scheme="chain",
                               llm=TargetConfig(name="t", source="hf", path=str(tiny_hf("llama3")[0])))
    if kind == "llm_other":  # another checkpoint: the target's weights, perturbed
        perturbed_copy(tiny_hf("llama3")[1], tmp_path / "other")
        return SimpleNamespace(kind="llm", num_draft=num_draft, scheme="chain",
                               llm=TargetConfig(name="d", source="hf", path=str(tmp_path / "other")))
    head_type = "medusa" if kind == "medusa" else "mtp"
    save_head(_fitted(loaded, tiny_hf, head_type), tmp_path / head_type)
    return SimpleNamespace(kind="head", checkpoint=str(tmp_path / head_type), num_draft=num_draft,
                           scheme="chain")


@pytest.mark.parametrize("kind", ["head", "llm_self", "llm_other", "medusa"])
def test_every_drafter_chain_greedy_is_lossless(tiny_hf, tmp_path, kind):
    loaded = _loaded(tiny_hf)
    eng = build_engine(loaded, EngineConfig(**CFG), _drafter_cfg(kind, loaded, tmp_path, tiny_hf))
    assert isinstance(eng.drafter, Drafter)
    # Max lengths differ per prompt, so K shrinks near the end for some requests only.
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 14, 20, 5, 17, 12)]
    prompts = _prompts()
    out = eng.generate(prompts, params, progress=False)
    assert [r.token_ids for r in out] == _ar(loaded, prompts, params)
    for r in out:
        assert len(r.token_ids) == r.meta["target_steps"] + sum(r.meta["accepted"])
        assert max(r.meta["proposed"]) <= 3
        if kind == "llm_self":  # an identical draft: every proposed draft is accepted
            assert r.meta["accepted"][1:] == r.meta["proposed"][1:] and max(r.meta["proposed"]) == 3
    proposed = sum(sum(r.meta["proposed"]) for r in out)
    accepted = sum(sum(r.meta["accepted"]) for r in out)
    if kind != "llm_self":  # drafts accepted well above chance (1/320), and some rejected
        assert 0.15 * proposed < accepted < proposed, (accepted, proposed)


def test_medusa_drafts_read_the_last_accepted_feature(tiny_hf, tmp_path):
    """After a prefill, d_1 and d_2 of the next round are heads 1 and 2 on the post-norm
    target feature of the prompt's last token; after a round, on the last accepted one."""
    loaded = _loaded(tiny_hf)
    head = _medusa(loaded, tmp_path / "m")
    # head_code=none: the drafter keeps the trained floats `head` holds (test_head_code.py
    # covers the rounded default).
    eng = build_engine(loaded, EngineConfig(**CFG, head_code="none"), SimpleNamespace(
        kind="head", checkpoint=str(tmp_path / "m"), num_draft=3, scheme="chain"))
    assert isinstance(eng.drafter, MedusaDrafter)
    req = eng.add_request(_prompts(1)[0], SamplingParams(max_new_tokens=20, ignore_eos=True))

    def expect(step):
        ids = req.token_ids[:-1]  # the feature of the token before the last emitted one
        out = loaded.model(torch.tensor(ids), TorchAttentionBackend().plan(BatchLayout.packed([len(ids)])))
        f = head.first_hidden(out.hidden[-1:], None)
        return head.logits(head.step(None, f, None, k=step)[1]).float()

    for _ in range(3):  # the prefill, then two rounds
        eng.step()
        state, logits = eng.drafter.begin_round([req], [req.num_cached])
        torch.testing.assert_close(logits, expect(1), rtol=1e-4, atol=1e-4)
        _, logits2 = eng.drafter.step([req], [req.num_cached], 1, logits.argmax(-1), state)
        torch.testing.assert_close(logits2, expect(2), rtol=1e-4, atol=1e-4)


def test_medusa_limits(tiny_hf, tmp_path):
    loaded = _loaded(tiny_hf)
    _medusa(loaded, tmp_path / "m", num_steps=2)
    with pytest.raises(ValueError, match=r"draft.num_draft=3 is more than the 2 draft positions"):
        build_engine(loaded, EngineConfig(**CFG), SimpleNamespace(
            kind="head", checkpoint=str(tmp_path / "m"), num_draft=3, scheme="chain"))
    with pytest.raises(ValueError, match="scheme=tree needs draft=head with an MTP/EAGLE head.*"
                                         "'medusa' head.*use scheme=chain"):
        build_engine(loaded, EngineConfig(**CFG), SimpleNamespace(
            kind="head", checkpoint=str(tmp_path / "m"), num_draft=2, scheme="tree", depth=2,
            topk=2, total_tokens=4))
    # The tree engine itself refuses a drafter that cannot grow trees.
    with pytest.raises(ValueError, match="scheme=tree needs draft=head"):
        TreeSpecEngine(loaded.model, None, EngineConfig(**CFG),
                       lambda p, ps, d, dt: LLMDrafter(loaded.model, p, ps, d, dt),
                       depth=2, topk=2, total_tokens=4)


def test_medusa_checkpoint_through_the_eval_cli(tmp_path):
    from inference_eval.evaluation import evaluate
    from inference_eval.evaluation.config import EvalConfig
    from inference_eval.hydra_app import compose

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "category": "math", "prompt": "What is 2+2?"}\n'
                       '{"id": "b", "category": "code", "prompt": "Write a loop."}\n')
    fast = ["target=tiny", "engine.attention=torch", "engine.num_pages=64", "eval.progress=false",
            "eval.batch_size=2", "sampling.max_new_tokens=8", "eval.warmup=false", "prompts=jsonl",
            f"prompts.path={prompts}"]
    base = compose("eval", EvalConfig, fast)
    _medusa(load_target(base.target), tmp_path / "medusa")
    cfg = compose("eval", EvalConfig, [*fast, "draft=head", f"draft.checkpoint={tmp_path / 'medusa'}",
                                       "draft.num_draft=3", "draft.name=medusa",
                                       f"output_dir={tmp_path / 'o'}"])
    report = evaluate.main(cfg)
    ar, medusa = report["runs"]
    assert medusa["name"] == "medusa" and medusa["scheme"] == "chain" and medusa["num_errors"] == 0
    assert medusa["lossless_check"] == {"compared": 2, "mismatched": 0, "mismatches": []}
    assert medusa["generated_tokens"] == ar["generated_tokens"]
    pre = medusa["prefill_steps"]
    assert medusa["mean_accept_len"] == pytest.approx(
        (medusa["generated_tokens"] - pre) / (medusa["target_steps"] - pre))
    assert len(medusa["per_position_accept_rate"]) == 3 and len(medusa["accept_len_hist"]) == 4
    assert (tmp_path / "o" / "report.json").is_file()


def test_eos_among_the_drafts_counts_only_the_emitted_drafts(tiny_hf):
    """Self-draft, K = 3: every round emits 3 drafts + 1 target token. A token that first
    appears as draft 1 or 2 of a round is made the EOS: that round must record proposed =
    accepted = the drafts up to the EOS (before the fix: 3 and 3), output stops there."""
    loaded = _loaded(tiny_hf)
    prompt = _prompts(1, seed=3)[0]
    free = _ar(loaded, [prompt], SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
    # Output index 0 comes from the prefill; round r emits indices 4r-3 .. 4r (drafts first).
    idx = next(i for i in range(1, len(free)) if (i - 1) % 4 < 2 and free.index(free[i]) == i)
    eos = {free[idx]}
    make = lambda p, ps, d, dt: LLMDrafter(loaded.model, p, ps, d, dt)  # noqa: E731
    eng = SpecEngine(loaded.model, None, EngineConfig(**CFG), make, max_accepted=3)
    eng.eos_ids = eos
    params = SamplingParams(max_new_tokens=40)
    (r,) = eng.generate([prompt], params, progress=False)
    assert r.token_ids == free[:idx + 1] == _ar(loaded, [prompt], params, eos)[0]
    assert r.finish_reason == "stop"
    took = (idx - 1) % 4 + 1  # drafts emitted in the last round, the EOS included
    assert r.meta["proposed"][-1] == r.meta["accepted"][-1] == took < 3
    assert r.meta["accepted"][1:-1] == r.meta["proposed"][1:-1] == [3] * (len(r.meta["accepted"]) - 2)
    # Every round but the last emitted accepted + 1 tokens; the last one only its drafts.
    assert len(r.token_ids) == r.meta["target_steps"] + sum(r.meta["accepted"]) - 1
    out = TurnOutput.from_result("a", "c", 0, r)
    assert out.ok
    rates = per_position_accept_rate([out], 3)
    assert rates[:took] == [1.0] * took and all(x in (None, 1.0) for x in rates)


def _ref_path_proposed(tree: DraftTree, path, acc) -> list[int]:
    out = []
    for b in range(tree.batch_size):
        last = int(path[b, int(acc[b])])
        kids = [j for j in range(tree.num_nodes)
                if bool(tree.valid[b, j]) and int(tree.parents[b, j]) == last]
        out.append(int(acc[b]) + (1 if kids else 0))
    return out


def test_tree_path_proposed_matches_a_loop():
    # Request 0: root -> 1 -> 3 (depth 2), root -> 2; request 1: root only; request 2: root -> 1.
    parents = torch.tensor([[-1, 0, 0, 1], [-1, -1, -1, -1], [-1, 0, -1, -1]])
    valid = parents >= 0
    valid[:, 0] = True
    depth = torch.tensor([[0, 1, 1, 2], [0, 0, 0, 0], [0, 1, 0, 0]])
    tree = DraftTree(torch.tensor([[5, 6, 7, 8], [5, 0, 0, 0], [5, 9, 0, 0]]), parents, depth, valid,
                     torch.where(valid, 0.0, float("-inf")))
    for accepted_path, acc, want in [
        ([[0, 1, 3], [0, -1, -1], [0, 1, -1]], [2, 0, 1], [2, 0, 1]),   # all leaves reached
        ([[0, 1, -1], [0, -1, -1], [0, -1, -1]], [1, 0, 0], [2, 0, 1]),  # rejected below
        ([[0, 2, -1], [0, -1, -1], [0, -1, -1]], [1, 0, 0], [1, 0, 1]),  # node 2 is a leaf
    ]:
        path, acc = torch.tensor(accepted_path), torch.tensor(acc)
        got = tree_path_proposed(tree, path, acc).tolist()
        assert got == want == _ref_path_proposed(tree, path, acc)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # random trees against the loop, on greedy verification's paths
        b, n = 4, 9
        par = torch.stack([torch.tensor([-1] + [int(torch.randint(0, j, (1,), generator=g))
                                                for j in range(1, n)]) for _ in range(b)])
        ok = torch.rand(b, n, generator=g) < 0.7
        ok[:, 0] = True
        for j in range(1, n):  # a node is valid only under a valid parent
            ok[:, j] &= ok.gather(1, par[:, j:j + 1].clamp(min=0)).squeeze(1)
        dep = torch.zeros(b, n, dtype=torch.long)
        for j in range(1, n):
            dep[:, j] = dep.gather(1, par[:, j:j + 1]).squeeze(1) + 1
        t = DraftTree(torch.randint(0, 4, (b, n), generator=g), torch.where(ok, par, -1),
                      torch.where(ok, dep, 0), ok, torch.where(ok, 0.0, float("-inf")))
        path, acc, _ = verify_tree_greedy(t, torch.randn(b, n, 4, generator=g))
        assert tree_path_proposed(t, path, acc).tolist() == _ref_path_proposed(t, path, acc)


def test_tree_alpha_skips_depths_the_pruned_tree_never_reached(tiny_hf):
    """depth 4 but total_tokens 2 with one child per node: the pruned tree is a line of two
    drafts, which the oracle accepts every round. α_3 and α_4 were never attempted (before
    the fix every round recorded proposed = 4, so α_3 read 0)."""
    from test_spec_tree_engine import OracleDrafter

    loaded = _loaded(tiny_hf)
    eng = TreeSpecEngine(loaded.model, None, EngineConfig(**CFG),
                         lambda p, ps, d, dt: OracleDrafter(loaded.model, p, ps, d, dt),
                         depth=4, topk=1, total_tokens=2)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    prompts = _prompts(3, seed=4)
    out = eng.generate(prompts, params, progress=False)
    assert [r.token_ids for r in out] == _ar(loaded, prompts, params)
    for r in out:
        assert r.meta["proposed"][1:] == r.meta["accepted"][1:]
        assert max(r.meta["proposed"]) == 2
    rates = per_position_accept_rate([TurnOutput.from_result(str(i), "c", 0, r)
                                      for i, r in enumerate(out)], 4)
    assert rates == [1.0, 1.0, None, None]


def test_engines_only_call_the_drafter_interface():
    """No engine asks which drafter it holds or reads a drafter's private state."""
    verbs = {"prefill", "draft_lengths", "begin_round", "step", "confidence", "accept", "verified",
             "run", "grow", "drop", "bind", "warm",
             "aux_layers", "drafts_trees", "max_steps", "sync_free"}
    for name in ("spec_engine.py", "tree_engine.py"):
        tree = ast.parse((SPEC / name).read_text())
        used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute) and node.value.attr == "drafter"}
        assert used <= verbs, (name, used - verbs)
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                 and getattr(node.func, "id", None) == "isinstance"]
        assert not calls, name
