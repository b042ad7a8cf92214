"""Launch gloo ranks on the CPU for the tensor-parallel tests (a plain module, imported as
`tp_ranks`): each rank is a spawned process with torchrun's environment variables, runs a
worker function of this module and leaves its result in a file; the parent waits with a
deadline, so a hung rank fails the test instead of the suite."""
from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn_name: str, args: tuple, out: str,
               torchrun_env: bool) -> None:
    if torchrun_env:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # ranks share 2 cores
    import inference_eval  # noqa: F401  (its OpenBLAS setting precedes numpy's first use)

    try:
        result = {"ok": globals()[fn_name](*args)}
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    torch.save(result, out)


def run_ranks(fn_name: str, world: int, *args, tmp: Path, timeout: float = 120,
              torchrun_env: bool = True) -> list[dict]:
    """Run worker `fn_name`(*args) on `world` ranks; returns each rank's {"ok": result} or
    {"error", "traceback"}, or {"exitcode"} for a rank that left none (killed at the deadline:
    exitcode None)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    outs = [str(tmp / f"rank{r}.pt") for r in range(world)]
    for out in outs:  # a result left by an earlier run in the same folder
        if os.path.exists(out):
            os.remove(out)
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, fn_name, args, outs[r],
                                                  torchrun_env)) for r in range(world)]
    env = os.environ.copy()
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for p in procs:
            p.start()
    finally:
        os.environ.clear()
        os.environ.update(env)
    import time

    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    results = []
    for p, out in zip(procs, outs):
        if p.is_alive():
            p.kill()
            p.join()
            results.append({"exitcode": None})
        elif os.path.exists(out):
            results.append(torch.load(out, weights_only=False))
        else:
            results.append({"exitcode": p.exitcode})
    return results


def leader_result(results: list[dict]):
    """Rank 0's result; every rank must have finished cleanly."""
    for r, res in enumerate(results):
        assert "ok" in res, f"rank {r}: {res.get('error') or res}\n{res.get('traceback', '')}"
    return results[0]["ok"]


# ---- workers (run inside the ranks) -------------------------------------------------------

def parity_inputs() -> tuple[list[list[int]], list[list[int]]]:
    """(3 sequences for packed logits, 8 prompts of different lengths for greedy generation
    with continuous batching), token ids of a 320-token vocabulary."""
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (23, 9, 4)]
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist()
               for n in (3, 17, 5, 30, 9, 1, 12, 24)]
    return seqs, prompts


def spec_summary(results, engine) -> dict:
    """What a speculative run is compared by: tokens, accepted/proposed per step, rounds."""
    return {"tokens": [r.token_ids for r in results],
            "accepted": [list(r.meta["accepted"]) for r in results],
            "proposed": [list(r.meta["proposed"]) for r in results],
            "rounds": engine.counters["rounds"]}


def assert_lossless_as_tp1(got: dict, ref: dict, ar: list, name) -> None:
    """got (at T > 1) equals autoregressive output, accepts over 15% of its drafts, and
    accepts per step and rounds exactly what ref (the same drafter at T=1) does."""
    assert got["tokens"] == ar, name
    proposed = sum(map(sum, got["proposed"]))
    accepted = sum(map(sum, got["accepted"]))
    assert accepted > 0.15 * proposed > 0, (name, accepted, proposed)
    assert (got["accepted"], got["proposed"]) == (ref["accepted"], ref["proposed"]), name
    assert got["rounds"] == ref["rounds"], name


def packed_logits(model, seqs: list[list[int]]) -> torch.Tensor:
    """Every row's logits [T, V] of whole sequences in one cacheless step (all ranks call it)."""
    from inference_eval.engine.attention import BatchLayout
    from inference_eval.engine.attention.torch_backend import TorchAttentionBackend

    ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    plan = TorchAttentionBackend().plan(BatchLayout.packed([len(s) for s in seqs]))
    with torch.inference_mode():
        return model(ids, plan).logits


def generate_greedy(engine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from inference_eval.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    return [r.token_ids for r in engine.generate(prompts, params, chat=False, progress=False)]


def parity_worker(cases: dict, seqs: list[list[int]], prompts: list[list[int]],
                  engine_kw: dict, max_new_tokens: int) -> dict:
    """Per case (name -> hf_dir, or (hf_dir, expert_parallel) for a DeepSeek target): the
    split target's logits, greedy generations through the one-scheduler engine, its
    identity, the collectives of one decode step."""
    from inference_eval.engine.config import EngineConfig
    from inference_eval.engine.parallel import comm
    from inference_eval.engine.parallel.group import init_tensor_parallel
    from inference_eval.engine.parallel.runner import load_tp_target, serve
    from inference_eval.engine.parallel.tp import local_parameter_bytes
    from inference_eval.engine.target import TargetConfig

    from inference_eval.engine.parallel import step_sync

    # A 16-entry step buffer: prefills outgrow it, so the resize messages run too.
    step_sync.StepChannel.__init__.__defaults__ = (16,)
    world = int(os.environ["WORLD_SIZE"])
    tp = init_tensor_parallel(world, "cpu", timeout_s=60)
    out = {}
    for name, case in cases.items():
        hf_dir, expert_parallel = (case, False) if isinstance(case, str) else case
        loaded, plan = load_tp_target(TargetConfig(name=name, source="hf", path=hf_dir), tp,
                                      expert_parallel=expert_parallel,
                                      with_tokenizer=False)
        res = {"identity": loaded.identity, "param_bytes": local_parameter_bytes(loaded.model),
               "logits": packed_logits(loaded.model, seqs)}
        with serve(loaded, plan, EngineConfig(**engine_kw), tp) as engine:
            if engine is not None:
                comm.reset()
                res["tokens"] = generate_greedy(engine, prompts, max_new_tokens)
                res["steps"], res["broadcasts"] = engine.num_steps, comm.COUNTS["broadcast"]
                comm.reset()
                generate_greedy(engine, prompts[:1], 2)  # a prefill, then one decode step
                res["collectives_prefill_decode"] = dict(comm.COUNTS)
        out[name] = res
    return out


class _RecordingSlice:
    def __init__(self, sl, name: str, reads: dict) -> None:
        self.sl, self.name, self.reads = sl, name, reads

    def get_shape(self):
        return self.sl.get_shape()

    def __getitem__(self, index):
        t = self.sl[index]
        self.reads.setdefault(self.name, []).append(t.numel())
        return t


class _RecordingOpen:
    """safetensors.safe_open, recording the elements each read returns: get_tensor (whole)
    under "full", slices under "slices"."""

    log: dict = {"full": {}, "slices": {}}

    def __init__(self, path, framework, **kw) -> None:
        from safetensors import safe_open

        self.f = safe_open(path, framework=framework, **kw)

    def __enter__(self):
        self.f.__enter__()
        return self

    def __exit__(self, *exc):
        return self.f.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name: str):
        t = self.f.get_tensor(name)
        self.log["full"][name] = t.numel()
        return t

    def get_slice(self, name: str):
        return _RecordingSlice(self.f.get_slice(name), name, self.log["slices"])


def memory_worker(hf_dir: str, expert_parallel: bool = False) -> dict:
    """This rank's parameter bytes after a sharded load, every read it made, its parameters."""
    from inference_eval.engine.parallel import loading
    from inference_eval.engine.parallel.group import init_tensor_parallel
    from inference_eval.engine.parallel.runner import load_tp_target
    from inference_eval.engine.parallel.tp import local_parameter_bytes
    from inference_eval.engine.target import TargetConfig

    loading.safe_open = _RecordingOpen
    tp = init_tensor_parallel(int(os.environ["WORLD_SIZE"]), "cpu", timeout_s=60)
    loaded, _ = load_tp_target(TargetConfig(source="hf", path=hf_dir), tp, with_tokenizer=False,
                               expert_parallel=expert_parallel)
    return {"param_bytes": local_parameter_bytes(loaded.model), "reads": _RecordingOpen.log,
            "identity": loaded.identity,
            "params": {n: p.detach().clone() for n, p in loaded.model.named_parameters()}}


def error_worker(hf_dir: str, tensor_parallel: int) -> str:
    """Load a target that `tensor_parallel` ranks cannot split: the error, on every rank."""
    from inference_eval.engine.parallel.group import init_tensor_parallel
    from inference_eval.engine.parallel.runner import load_tp_target
    from inference_eval.engine.target import TargetConfig

    tp = init_tensor_parallel(tensor_parallel, "cpu", timeout_s=30)
    load_tp_target(TargetConfig(source="hf", path=hf_dir), tp, with_tokenizer=False)
    return "loaded"


def dying_worker(hf_dir: str, timeout_s: float) -> dict:
    """Rank 1 dies after loading; the leader then generates: it must stop with an error."""
    import time

    from inference_eval.engine.config import EngineConfig
    from inference_eval.engine.parallel.group import init_tensor_parallel
    from inference_eval.engine.parallel.runner import load_tp_target, serve
    from inference_eval.engine.target import TargetConfig

    tp = init_tensor_parallel(int(os.environ["WORLD_SIZE"]), "cpu", timeout_s=timeout_s)
    loaded, plan = load_tp_target(TargetConfig(source="hf", path=hf_dir), tp, with_tokenizer=False)
    if tp.rank == 1:
        os._exit(3)
    t0 = time.monotonic()
    try:
        with serve(loaded, plan, EngineConfig(page_size=4, num_pages=32), tp) as engine:
            generate_greedy(engine, [[5, 6, 7]], 4)
    except Exception as exc:  # noqa: BLE001 - what the test inspects
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0],
                "seconds": time.monotonic() - t0}
    return {"error": None}


def smollm2_worker(prompts: list[list[int]], max_new_tokens: int, engine_kw: dict) -> dict:
    """The embedded target (GGUF, through its converted cache) split over the world."""
    from inference_eval.engine.config import EngineConfig
    from inference_eval.engine.parallel.group import init_tensor_parallel
    from inference_eval.engine.parallel.runner import load_tp_target, serve
    from inference_eval.engine.target import TargetConfig

    tp = init_tensor_parallel(int(os.environ["WORLD_SIZE"]), "cpu", timeout_s=120)
    loaded, plan = load_tp_target(TargetConfig(), tp, with_tokenizer=False)
    out = {"identity": loaded.identity}
    with serve(loaded, plan, EngineConfig(**engine_kw), tp) as engine:
        if engine is not None:
            out["tokens"] = generate_greedy(engine, prompts, max_new_tokens)
    return out


def block_heads_worker(hf_dir: str, cases: dict, prompts: list[list[int]], max_new: list[int],
                       engine_kw: dict) -> dict:
    """Per draft case (name -> draft config): greedy speculative generation at the world's
    size (tokens, accepted and proposed per round, rounds), then the collectives of single
    head calls: a DFlash block pass and context write, a chain head's step."""
    from inference_eval.engine.attention import BatchLayout
    from inference_eval.engine.config import EngineConfig
    from inference_eval.engine.parallel import comm
    from inference_eval.engine.parallel.group import init_tensor_parallel
    from inference_eval.engine.parallel.runner import load_tp_target, serve
    from inference_eval.engine.sampling import SamplingParams
    from inference_eval.engine.target import TargetConfig
    from inference_eval.evaluation.engines import build_tp_spec_engine

    tp = init_tensor_parallel(int(os.environ["WORLD_SIZE"]), "cpu", timeout_s=60)
    loaded, plan = load_tp_target(TargetConfig(name="llama3", source="hf", path=hf_dir), tp,
                                  with_tokenizer=False)
    h = loaded.model.arch.hidden_size
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in max_new]
    out = {}
    for name, draft in cases.items():
        build, make = build_tp_spec_engine(loaded, plan, tp, draft)
        with serve(loaded, plan, EngineConfig(**engine_kw), tp, build, make) as engine:
            if engine is None:
                continue
            res = engine.generate(prompts, params, progress=False)
            got = {**spec_summary(res, engine), "calls": {}}
            d = engine.drafter
            with torch.inference_mode():
                if name == "dflash":  # one block of B = 4 rows, then a context write of 2
                    ones = torch.ones(4, 4, dtype=torch.bool)
                    layout = BatchLayout([4], [8], [[0, 1]], 4, tree_masks=[ones])
                    comm.reset()
                    d.run(torch.tensor([5, 7, 7, 7]), None, engine.backend.plan(layout),
                          torch.tensor([1, 2, 3]))
                    got["calls"]["block"] = dict(comm.COUNTS)
                    comm.reset()
                    d._cache_context(torch.zeros(2, h), BatchLayout([2], [2], [[0]], 4))
                    got["calls"]["context"] = dict(comm.COUNTS)
                elif name == "eagle3_reduced":  # a draft step: no gather of logits
                    layout = BatchLayout(q_lens=[1], kv_lens=[1], block_tables=[[0]], page_size=4)
                    comm.reset()
                    _, logits = d.run(torch.tensor([5]), torch.zeros(1, h),
                                      engine.backend.plan(layout), torch.tensor([0]))
                    got["calls"]["step"] = dict(comm.COUNTS)
                    got["calls"]["finite"] = int(torch.isfinite(logits).sum())
            out[name] = got
    return out


def deepseek_heads_worker(cases: dict, prompts: list[list[int]], max_new: list[int],
                          engine_kw: dict) -> dict:
    """Per draft case (name -> (DeepSeek hf_dir, draft config, expert_parallel)) over the
    target split with its routed experts TP-MoE or EP: greedy speculative generation at the
    world's size (tokens, accepted and proposed per round, rounds, the collectives of one
    draft step; leader only) and the split of the head's layer and cache on this rank."""
    from inference_eval.engine.attention import BatchLayout
    from inference_eval.engine.config import EngineConfig
    from inference_eval.engine.parallel import comm
    from inference_eval.engine.parallel.group import init_tensor_parallel
    from inference_eval.engine.parallel.runner import load_tp_target, serve
    from inference_eval.engine.sampling import SamplingParams
    from inference_eval.engine.target import TargetConfig
    from inference_eval.evaluation.engines import build_tp_spec_engine

    tp = init_tensor_parallel(int(os.environ["WORLD_SIZE"]), "cpu", timeout_s=60)
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in max_new]
    targets, out = {}, {}
    for name, (hf_dir, draft, expert_parallel) in cases.items():
        if (hf_dir, expert_parallel) not in targets:
            targets[hf_dir, expert_parallel] = load_tp_target(
                TargetConfig(name="deepseek", source="hf", path=hf_dir), tp,
                expert_parallel=expert_parallel, with_tokenizer=False)
        loaded, plan = targets[hf_dir, expert_parallel]
        build, make = build_tp_spec_engine(loaded, plan, tp, draft)
        probe = make(1, 4, "cpu", torch.float32)  # this rank's drafter: no collective
        layer, cache = probe.head.layer, probe.cache
        experts = getattr(layer.mlp, "experts", None)
        out[name] = {"split": {"mlp": type(layer.mlp).__name__,
                               "query_heads": layer.self_attn.heads,
                               "experts": None if experts is None
                               else tuple(experts.gate_up_proj.shape),
                               "cache_row": tuple(cache.k.shape[-2:]),
                               "cache_latent": cache.is_latent}}
        with serve(loaded, plan, EngineConfig(**engine_kw), tp, build, make) as engine:
            if engine is None:
                continue
            res = engine.generate(prompts, params, progress=False)
            out[name].update(spec_summary(res, engine))
            layout = BatchLayout(q_lens=[1], kv_lens=[1], block_tables=[[0]], page_size=4)
            h = loaded.model.arch.hidden_size
            comm.reset()  # one draft step
            with torch.inference_mode():
                engine.drafter.run(torch.tensor([5]), torch.zeros(1, h),
                                   engine.backend.plan(layout), torch.tensor([0]))
            out[name]["step_calls"] = dict(comm.COUNTS)
    return out
