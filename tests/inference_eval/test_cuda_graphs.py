"""CUDA graphs of the engine's steps (model/cuda_graphs.py).

On CPU the code path runs against stand-ins (tests/fake_flashinfer.py): FlashInfer's paged
wrappers with their CUDA-graph buffers, and a graph whose replay re-runs the captured closure
on the graph's own buffers. Replays must give what the eager engine gives, token for token, as
page tables, lengths and batch sizes change. The GPU tests at the end capture real CUDA
graphs around real FlashInfer kernels.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fake_flashinfer import MODULE, FakeGraph
from inference_eval.engine.attention import flashinfer_backend as fib
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.model.cuda_graphs import CudaGraphs
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.speculative.drafters import LLMDrafter
from inference_eval.engine.speculative.spec_engine import SpecEngine
from inference_eval.engine.target import TargetConfig, load_target
from engine_cases import load_tiny as _loaded, random_prompts

CFG = dict(page_size=4)


def _prompts(k, seed=3):
    return random_prompts(k, seed, 20)


@pytest.fixture
def stand_ins(monkeypatch):
    """Engines built with attention=flashinfer get the CPU stand-in backend; with
    cuda_graphs on, graphs are FakeGraphs. Returns the registries made, in order."""
    made = []
    monkeypatch.setattr(fib, "SUPPORTED_DTYPES", (torch.float32,))

    def backend(name, device, dtype):
        b = fib.FlashInferBackend(device, workspace_bytes=16, module=MODULE)
        return b

    class Graphs(CudaGraphs):
        def __init__(self, b, **kw):
            super().__init__(b, graph_factory=FakeGraph, **kw)
            made.append(self)

    import inference_eval.engine.llm_engine as le

    monkeypatch.setattr(le, "make_backend", backend)
    monkeypatch.setattr(le, "CudaGraphs", Graphs)
    return made


def _run(loaded, prompts, params, graphs: bool, **kw):
    eng = LLMEngine(loaded.model, None, EngineConfig(attention="flashinfer", cuda_graphs=graphs,
                                                     **CFG, **kw))
    return [r.token_ids for r in eng.generate(prompts, params, progress=False)], eng


def test_stand_in_matches_the_torch_backend(tiny_hf, stand_ins):
    """The stand-in attends like the torch backend: the same greedy tokens."""
    loaded = _loaded(tiny_hf)
    prompts, params = _prompts(3), SamplingParams(max_new_tokens=8, ignore_eos=True)
    ref = [r.token_ids for r in LLMEngine(loaded.model, None, EngineConfig(attention="torch", **CFG))
           .generate(prompts, params, progress=False)]
    assert _run(loaded, prompts, params, graphs=False)[0] == ref


def test_graph_replays_equal_eager_decoding_as_the_batch_shrinks(tiny_hf, stand_ins):
    """Three requests of different lengths finish at different steps: decode graphs of
    batch 3, 2 and 1 are captured once and replayed with new page tables every step."""
    loaded = _loaded(tiny_hf)
    prompts = _prompts(3, seed=7)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (6, 11, 17)]
    eager, _ = _run(loaded, prompts, params, graphs=False)
    got, eng = _run(loaded, prompts, params, graphs=True)
    assert got == eager
    g = eng.backend.graphs
    decode_batches = sorted(len(k[4]) for k in g.entries if k[3] == "decode")
    assert decode_batches == [1, 2, 3]
    assert g.captures == len(g.entries) and g.replays >= 17 - 3 - 3
    # Each graph wrapper was planned again for every replay (new lengths), not once.
    assert all(w.plans > 1 for w in g._wrappers.values())


def test_a_stale_buffer_would_show(tiny_hf, stand_ins):
    """The replay path is what makes the tokens right: replaying without copying the new
    cache slots in (the step's k/v written over the previous step's) changes the output."""
    loaded = _loaded(tiny_hf)
    prompts, params = _prompts(1, seed=11), SamplingParams(max_new_tokens=12, ignore_eos=True)
    eager, _ = _run(loaded, prompts, params, graphs=False)
    import inference_eval.engine.model.cuda_graphs as cg

    class Stale(cg._Entry):
        @property
        def slots(self):
            return self.__dict__["_slots"].clone()  # copies land in a throwaway tensor

        @slots.setter
        def slots(self, value):
            self.__dict__["_slots"] = value

    orig = cg._Entry
    cg._Entry = Stale
    try:
        got, eng = _run(loaded, prompts, params, graphs=True)
    finally:
        cg._Entry = orig
    assert eng.backend.graphs.replays > 0 and got != eager


def test_speculative_rounds_replay_verification_graphs(tiny_hf, stand_ins):
    """Self-drafting accepts every draft: the K=2 verification (3 rows, paged kind) and the
    draft model's decode steps replay as graphs; output equals autoregressive decoding."""
    loaded = _loaded(tiny_hf)
    prompt = _prompts(1, seed=9)[0]
    params = SamplingParams(max_new_tokens=13, ignore_eos=True)
    (ref,), _ = _run(loaded, [prompt], params, graphs=False)
    make = lambda p, ps, d, dt: LLMDrafter(loaded.model, p, ps, d, dt)  # noqa: E731
    eng = SpecEngine(loaded.model, None, EngineConfig(attention="flashinfer", **CFG), make,
                     max_accepted=2)
    (r,) = eng.generate([prompt], params, progress=False)
    assert r.token_ids == ref
    assert sum(r.meta["accepted"]) >= 8 and r.meta["accepted"][1] == 2
    g = eng.backend.graphs
    kinds = {(k[3], k[4]) for k in g.entries}
    assert ("paged", (3,)) in kinds and ("decode", (1,)) in kinds
    assert len({k[1] for k in g.entries}) == 2  # the target's cache and the draft's
    assert g.replays > g.captures


def test_head_drafts_and_refills_replay_as_graphs(tiny_hf, stand_ins):
    """An MTP head fitted on the target's text: its draft steps and refills run as graphs,
    tokens equal autoregressive decoding and the accepted lengths equal the eager run's."""
    from fit_head import fit_head_on
    from inference_eval.evaluation.engines import build_engine

    loaded = _loaded(tiny_hf)
    prompts = _prompts(2, seed=21)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    ar, _ = _run(loaded, prompts, params, graphs=False)
    import tempfile

    from heads.checkpoint import save_head

    path = tempfile.mkdtemp() + "/mtp"
    save_head(fit_head_on(loaded, [p + a for p, a in zip(prompts, ar)]), path)
    draft = SimpleNamespace(kind="head", checkpoint=path, num_draft=2, scheme="chain",
                            sync_free=False)
    runs = []
    for graphs in (False, True):
        eng = build_engine(loaded, EngineConfig(attention="flashinfer", cuda_graphs=graphs, **CFG),
                           draft)
        runs.append([eng.generate([p], params, progress=False)[0] for p in prompts])
    eager_out, graph_out = runs
    assert [r.token_ids for r in graph_out] == ar
    assert [r.meta["accepted"] for r in graph_out] == [r.meta["accepted"] for r in eager_out]
    accepted = sum(sum(r.meta["accepted"]) for r in graph_out)
    assert accepted > 0.3 * sum(sum(r.meta["proposed"]) for r in graph_out)
    head_kinds = {k[3] for k in eng.backend.graphs.entries if k[0] is eng.drafter.head}
    assert head_kinds == {"decode", "paged"}  # draft steps, refills


def test_graph_cap_and_off_switch_run_eagerly(tiny_hf, stand_ins):
    loaded = _loaded(tiny_hf)
    prompts, params = _prompts(2, seed=5), SamplingParams(max_new_tokens=6, ignore_eos=True)
    eager, eng = _run(loaded, prompts, params, graphs=False)
    assert eng.backend.graphs is None
    eng = LLMEngine(loaded.model, None, EngineConfig(attention="flashinfer", **CFG))
    eng.backend.graphs.max_graphs = 1
    assert [r.token_ids for r in eng.generate(prompts, params, progress=False)] == eager
    assert len(eng.backend.graphs.entries) == 1


def test_aux_layers_come_back_in_the_order_asked(tiny_hf, stand_ins):
    """EAGLE-3 reads target layers in its own order: a graphed step returns them as listed
    (here reversed), as the eager step does; outside inference mode nothing is graphed."""
    from inference_eval.engine.attention import BatchLayout

    loaded = _loaded(tiny_hf)
    ids = (torch.arange(21) * 37 + 5) % 320
    pages = list(range(6))
    outs = []
    for graphs in (False, True):
        eng = LLMEngine(loaded.model, None, EngineConfig(attention="flashinfer", cuda_graphs=graphs,
                                                         **CFG))
        with torch.inference_mode():
            loaded.model(ids[:18], eng.backend.plan(BatchLayout([18], [18], [pages], 4)), eng.cache)
            out = loaded.model(ids[18:], eng.backend.plan(BatchLayout([3], [21], [pages], 4)),
                               eng.cache, aux_layers=(2, 0))
        outs.append(out.aux)
    assert eng.backend.graphs.captures == 1  # the 3-row step (an 18-row prefill is not graphed)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    assert not torch.equal(outs[1][:, 0], outs[1][:, 1])
    with torch.no_grad():
        loaded.model(ids[18:19], eng.backend.plan(BatchLayout([1], [19], [pages], 4)), eng.cache)
    assert eng.backend.graphs.captures == 1


def test_torch_backend_engines_have_no_graphs(tiny_hf):
    loaded = _loaded(tiny_hf)
    eng = LLMEngine(loaded.model, None, EngineConfig(attention="torch", **CFG))
    assert eng.backend.graphs is None


# ---- on a GPU: real CUDA graphs around real FlashInfer kernels ----------------------------

GPU_ARCH = dict(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=256,
                intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                max_position_embeddings=512, tie_word_embeddings=False, eos_token_ids=[2])
PAGE = 16
# Two requests: a prefill of 13 + 21 tokens, three decode steps, a 3-row verification each,
# three more decode steps; both cross into their second page.
STEPS = [[13, 21], [1, 1], [1, 1], [1, 1], [3, 3], [1, 1], [1, 1], [1, 1]]
TABLES = [[3, 0], [5, 1]]
LOGIT_ATOL = 0.25  # logits ~N(0, 2-3) (lm_head scaled below); a wrong table or slot moves O(1)
needs_gpu = pytest.mark.skipif(not fib.available(), reason="CUDA graphs of FlashInfer steps "
                               "need CUDA and flashinfer-python")


@pytest.fixture(scope="module")
def gpu_model():
    t = load_target(TargetConfig(name="tiny_gqa_512", source="random", arch=dict(GPU_ARCH),
                                 dtype="bfloat16"), device="cuda", with_tokenizer=False)
    with torch.no_grad():
        t.model.lm_head.weight.mul_(10.0)  # greedy margins well above bf16 noise
    return t


def _teacher_forced(model, backend, seqs):
    from inference_eval.engine.attention import BatchLayout
    from inference_eval.engine.kv_cache import KVCache

    cache = KVCache.for_arch(model.arch, 8, PAGE, torch.bfloat16, "cuda")
    done, out = [0, 0], []
    with torch.inference_mode():
        for q_lens in STEPS:
            kv = [c + q for c, q in zip(done, q_lens)]
            ids = torch.cat([s[c:c + q] for s, c, q in zip(seqs, done, q_lens)])
            out.append(model(ids, backend.plan(BatchLayout(q_lens, kv, TABLES, PAGE)), cache).logits)
            done = kv
    return torch.cat(out), cache


@pytest.mark.gpu
@needs_gpu
def test_gpu_graph_steps_match_eager_steps(gpu_model):
    """Prefill, decode and verification steps replayed as CUDA graphs give the eager
    FlashInfer steps' logits and cache rows (bf16 noise apart) at every step."""
    from inference_eval.engine.attention import make_backend

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 512, (n,), generator=g).to("cuda") for n in (22, 30)]
    eager, eager_cache = _teacher_forced(gpu_model.model, make_backend("flashinfer", "cuda"), seqs)
    be = make_backend("flashinfer", "cuda")
    be.graphs = CudaGraphs(be)
    graphed, graph_cache = _teacher_forced(gpu_model.model, be, seqs)
    assert be.graphs.captures == 2 and be.graphs.replays == 5  # decode x6, verify (prefill: eager)
    torch.testing.assert_close(graphed, eager, atol=LOGIT_ATOL, rtol=0.05)
    assert graphed.argmax(-1).tolist() == eager.argmax(-1).tolist()
    torch.testing.assert_close(graph_cache.k.float(), eager_cache.k.float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(graph_cache.v.float(), eager_cache.v.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@needs_gpu
def test_gpu_graph_engines_generate_like_eager_ones(gpu_model):
    """Greedy decoding (batch 3, requests leaving) and self-drafted K=3 chains with graphs on
    give the eager engine's tokens; a divergence is accepted only at a near tie (within
    LOGIT_ATOL in the eager side's own logits; then that request is not compared further).
    Self-drafting accepts most drafts."""
    from inference_eval.engine.attention import BatchLayout
    from inference_eval.engine.attention.torch_backend import TorchAttentionBackend

    m = gpu_model.model
    prompts = [[5, 9, 17, 33, 200, 101, 7], list(range(40, 75)), [300, 11]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 16, 12)]
    cfg = dict(attention="flashinfer", page_size=PAGE, num_pages=64)
    ref = [r.token_ids for r in LLMEngine(m, None, EngineConfig(cuda_graphs=False, **cfg))
           .generate(prompts, params, progress=False)]
    ar = LLMEngine(m, None, EngineConfig(**cfg))
    make = lambda p, ps, d, dt: LLMDrafter(m, p, ps, d, dt)  # noqa: E731
    spec = SpecEngine(m, None, EngineConfig(**cfg), make, max_accepted=3)
    for eng in (ar, spec):
        outs = eng.generate(prompts, params, progress=False)
        # Spec rounds key their graphs by each request's rows: short runs replay fewer.
        assert eng.backend.graphs.replays > 0 and eng.backend.graphs.captures > 0
        for p, want, r in zip(prompts, ref, outs):
            got = r.token_ids
            assert len(got) == len(want)
            i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
            if i is None:
                continue
            ids = torch.tensor(p + want[:i], device="cuda")
            with torch.inference_mode():
                lg = m(ids, TorchAttentionBackend("cuda").plan(BatchLayout.packed([len(ids)])),
                       None).logits[-1]
            margin = (lg[want[i]] - lg[got[i]]).item()
            assert margin < LOGIT_ATOL, f"token {i} differs ({want[i]} vs {got[i]}), margin {margin:.3f}"
    accepted = sum(sum(r.meta["accepted"]) for r in outs)
    assert accepted > 0.6 * sum(sum(r.meta["proposed"]) for r in outs)
