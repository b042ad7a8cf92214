"""Speculative decoding at tensor-parallel size 2 (gloo ranks on the CPU, the tiny random
Llama target): an MTP chain (and its sync-free round), an EAGLE-3 chain, Medusa heads, an
EAGLE-2 tree, a draft LLM on rank 0 and n-gram lookup on rank 0 are lossless (greedy =
autoregressive), with drafts accepted, and accept exactly what the same drafter accepts at
size 1; a head call is one broadcast plus the head's own collectives."""
from __future__ import annotations

import os
import traceback
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from heads.batch import PackedBatch
from heads.checkpoint import save_head
from heads.config import HeadConfig
from heads.registry import build_head
from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionBackend
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.target import TargetConfig
from inference_eval.evaluation.engines import build_engine, frozen_parts_of
from engine_cases import load_tiny, random_prompts
from fit_head import fit_head_on, train_steps
from tiny_hf_models import perturbed_copy
from tp_ranks import assert_lossless_as_tp1, free_port, spec_summary

ENGINE = dict(attention="torch", page_size=4, num_pages=128, head_code="none")
AUX = [0, 1, 2]
MAX_NEW = [14, 9, 16, 12]
CHAIN = dict(kind="head", num_draft=3, scheme="chain")


def _params(name: str = ""):
    """Greedy, or for the *_sampled cases temperature 0.8 (the engine's seeded generator: the
    leader draws as one process does, on logits equal to ~1e-6)."""
    temp = 0.8 if name.endswith("_sampled") else 0.0
    return [SamplingParams(temperature=temp, max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]


def _fit_eagle3(loaded, seqs, steps=60):
    """An EAGLE-3 head (aux layers 0..2) fitted on the target's own greedy text."""
    ids, lens = [t for s in seqs for t in s], [len(s) for s in seqs]
    with torch.no_grad():
        out = loaded.model(torch.tensor(ids), TorchAttentionBackend().plan(BatchLayout.packed(lens)),
                           None, compute_logits=False, aux_layers=AUX)
    head = build_head(HeadConfig(type="eagle3", aux_layers=AUX), frozen_parts_of(loaded), seed=0)
    batch = PackedBatch(torch.tensor(ids), out.hidden.float(),
                        torch.ones(len(ids), dtype=torch.bool), lens, out.aux.float())
    return train_steps(head, batch, steps, 3e-3, seed=0).eval()


def _cases(loaded, tiny_hf, tmp, greedy_text):
    mtp, eagle3, medusa = tmp / "mtp", tmp / "eagle3", tmp / "medusa"
    save_head(fit_head_on(loaded, greedy_text), mtp)
    save_head(fit_head_on(loaded, greedy_text, cfg=HeadConfig(type="medusa", num_steps=3)), medusa)
    save_head(_fit_eagle3(loaded, greedy_text), eagle3)
    perturbed_copy(tiny_hf("llama3")[1], tmp / "other")
    other = TargetConfig(name="other", source="hf", path=str(tmp / "other"))
    return {
        "mtp_chain": SimpleNamespace(**CHAIN, checkpoint=str(mtp)),
        "mtp_sync_free": SimpleNamespace(**CHAIN, checkpoint=str(mtp), sync_free=True),
        "eagle3_chain": SimpleNamespace(**CHAIN, checkpoint=str(eagle3)),
        "mtp_sampled": SimpleNamespace(**CHAIN, checkpoint=str(mtp)),
        "medusa_chain": SimpleNamespace(**CHAIN, checkpoint=str(medusa)),
        "mtp_tree": SimpleNamespace(kind="head", checkpoint=str(mtp), scheme="tree", depth=3,
                                    topk=2, total_tokens=6),
        "llm_rank0": SimpleNamespace(kind="llm", num_draft=3, scheme="chain", llm=other),
        "lookup_rank0": SimpleNamespace(kind="lookup", num_draft=3, scheme="chain", lookup=True,
                                        lookup_corpus=None, model_draft=None,
                                        lookup_min_match=2, lookup_max_match=8),
    }


def _table(seqs):
    import numpy as np

    from inference_eval.engine.speculative.lookup import NgramTable

    return NgramTable.build([np.array(s) for s in seqs], min_n=2, max_n=6, min_count=1)


# ---- inside the ranks ---------------------------------------------------------------------

def spec_worker(hf_dir, cases, prompts, corpus) -> dict:
    from inference_eval.engine.parallel import comm
    from inference_eval.engine.parallel.group import init_tensor_parallel
    from inference_eval.engine.parallel.runner import load_tp_target, serve
    from inference_eval.evaluation.engines import build_tp_spec_engine

    tp = init_tensor_parallel(int(os.environ["WORLD_SIZE"]), "cpu", timeout_s=60)
    loaded, plan = load_tp_target(TargetConfig(name="llama3", source="hf", path=hf_dir), tp,
                                  with_tokenizer=False)
    out = {}
    for name, draft in cases.items():
        build, make = build_tp_spec_engine(loaded, plan, tp, draft)
        with serve(loaded, plan, EngineConfig(**ENGINE), tp, build, make) as engine:
            if engine is None:
                continue
            if draft.kind == "lookup":
                engine.drafter.table = _table(corpus)
            comm.reset()
            res = spec_summary(engine.generate(prompts, _params(name), progress=False), engine)
            res["collectives"] = dict(comm.COUNTS)
            if name == "mtp_chain":  # one head call on its own: a draft step of one request
                comm.reset()
                layout = BatchLayout(q_lens=[1], kv_lens=[1], block_tables=[[0]], page_size=4)
                with torch.inference_mode():
                    engine.drafter.run(torch.tensor([5]), torch.zeros(1, loaded.model.arch.hidden_size),
                                       engine.backend.plan(layout), torch.tensor([0]))
                res["head_call"] = dict(comm.COUNTS)
                engine.generate(prompts[:1], _params()[:1], progress=False)  # grow the buffer
                comm.reset()
                one = engine.generate(prompts[:1], _params()[:1], progress=False)[0]
                res["one_request"] = (dict(comm.COUNTS), list(one.meta["proposed"]))
            if name == "medusa_chain":  # no attention, no embedding: the lm_head's gather
                comm.reset()
                with torch.inference_mode():
                    engine.drafter.run(torch.tensor([5]), torch.zeros(1, loaded.model.arch.hidden_size),
                                       None, k=2)
                res["head_call"] = dict(comm.COUNTS)
            out[name] = res
    return out


def _rank(rank, world, port, args, path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)  # ranks share 2 cores
    import inference_eval  # noqa: F401  (its OpenBLAS setting precedes numpy's first use)

    try:
        result = {"ok": spec_worker(*args)}
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    torch.save(result, path)


def _run_ranks(world, args, tmp, timeout=180) -> dict:
    ctx, port = mp.get_context("spawn"), free_port()
    paths = [tmp / f"spec_rank{r}.pt" for r in range(world)]
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, str(paths[r])))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
    for r, path in enumerate(paths):
        assert path.exists(), f"rank {r} left no result (killed or crashed)"
        res = torch.load(path, weights_only=False)
        assert "ok" in res, f"rank {r}: {res['error']}\n{res['traceback']}"
    return torch.load(paths[0], weights_only=False)["ok"]


# ---- the tests ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tiny_hf, tmp_path_factory):
    """(TP=2 results, TP=1 results, autoregressive tokens, layers) per case."""
    tmp = tmp_path_factory.mktemp("tp_spec")
    loaded = load_tiny(tiny_hf)
    prompts = random_prompts(4, 21, 20, bos=None)
    ar_engine = LLMEngine(loaded.model, None, EngineConfig(**ENGINE))
    ar = [r.token_ids for r in ar_engine.generate(prompts, _params(), progress=False)]
    text = [p + t for p, t in zip(prompts, ar)]
    cases = _cases(loaded, tiny_hf, tmp, text)
    one = {}
    for name, draft in cases.items():
        engine = build_engine(loaded, EngineConfig(**ENGINE), draft)
        if draft.kind == "lookup":
            engine.drafter.table = _table(text[:2])  # half the prompts are in the corpus
        one[name] = spec_summary(engine.generate(prompts, _params(name), progress=False), engine)
    two = _run_ranks(2, (str(tiny_hf("llama3")[0]), cases, prompts, text[:2]), tmp)
    return two, one, ar, loaded.model.arch.num_layers


@pytest.mark.parametrize("name", ["mtp_chain", "mtp_sync_free", "eagle3_chain", "medusa_chain",
                                  "mtp_tree",
                                  "llm_rank0", "lookup_rank0"])
def test_tp2_speculative_is_lossless_and_accepts_as_tp1(runs, name):
    two, one, ar, _ = runs
    got, ref = two[name], one[name]
    assert_lossless_as_tp1(got, ref, ar, name)


def test_tp2_sampled_chain_draws_as_tp1(runs):
    """Sampled verification (q from the head's gathered logits on rank 0): the same tokens
    and acceptances as one process with the same seed."""
    two, one, _, _ = runs
    got, ref = two["mtp_sampled"], one["mtp_sampled"]
    assert got["tokens"] == ref["tokens"]
    assert (got["accepted"], got["proposed"]) == (ref["accepted"], ref["proposed"])
    assert [len(t) for t in got["tokens"]] == MAX_NEW and sum(map(sum, got["accepted"])) > 0


def test_chain_round_is_k_plus_one_calls(runs):
    """One request, MTP chain: the prefill (target + head refill), then per round of k drafts
    k - 1 draft steps, the verify pass and the refill: k + 1 broadcasts and gathers, 3
    all-reduces per head call and 1 + 2L per target call (docs/parallelism.md)."""
    two, _, _, layers = runs
    counts, proposed = two["mtp_chain"]["one_request"]
    rounds = proposed[1:]  # entry 0: the prefill
    assert rounds and min(rounds) >= 1, proposed
    # the prefill's refill, k - 1 draft steps a round, a refill after every round but the
    # last (the request finished there: nothing to catch up)
    head_calls = 1 + sum(k - 1 for k in rounds) + len(rounds) - 1
    target_calls = 1 + len(rounds)
    assert counts == {"broadcast": head_calls + target_calls,
                      "all_reduce": 3 * head_calls + (1 + 2 * layers) * target_calls,
                      "gather": head_calls + target_calls}, (counts, proposed)


def test_draft_llm_and_lookup_never_broadcast(runs):
    """A rank-0 drafter adds no collective: a step is still one broadcast per target call,
    the target's all-reduces and one gather."""
    two, _, _, layers = runs
    for name in ("llm_rank0", "lookup_rank0"):
        c = two[name]["collectives"]
        calls = c["gather"]  # every target call samples or verifies some rows
        assert c["all_reduce"] == calls * (1 + 2 * layers), (name, c)
        assert calls <= c["broadcast"] <= calls + 3, (name, c)  # + the buffer's growth


def test_head_call_is_one_broadcast_plus_the_heads_collectives(runs):
    two, _, _, _ = runs
    # embedding all-reduce, o_proj and down_proj all-reduces, the lm_head's gather
    assert two["mtp_chain"]["head_call"] == {"broadcast": 1, "all_reduce": 3, "gather": 1}
    assert two["medusa_chain"]["head_call"] == {"broadcast": 1, "gather": 1}
