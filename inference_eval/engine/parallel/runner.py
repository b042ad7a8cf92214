"""The engine under tensor parallelism: one scheduler per replica, on its leader.

The leader runs LLMEngine as at size 1, over `TPLeader`, a model whose every call first
broadcasts the call (step_sync) and then runs the leader's shard. The other ranks run
`follow`: receive a call, plan the same layout on their own backend, run their shard against
their own KV-cache shard (same page ids, their KV heads), repeat until the leader stops them.
Per step that is one broadcast plus the model's collectives (comm.COUNTS).

    with tensor_parallel_engine(target_cfg, engine_cfg) as engine:
        if engine is not None:  # the replica's leader; followers skip the body
            results = engine.generate(prompts, params)
"""
from __future__ import annotations

import dataclasses
from contextlib import contextmanager, suppress
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from inference_eval.engine.attention import make_backend
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.kv_cache import KVCache
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.model.arch import ModelArch
from inference_eval.engine.model.linear import openblas_threads, set_cpu_blas
from inference_eval.engine.model.transformer import ModelOutput, TransformerLM
from inference_eval.engine.parallel.fingerprint import sharded_hashes
from inference_eval.engine.parallel.group import (TPGroup, close_tensor_parallel,
                                                  init_tensor_parallel)
from inference_eval.engine.parallel.loading import load_sharded
from inference_eval.engine.parallel.shard import ShardPlan, check_arch
from inference_eval.engine.parallel.spec import LeaderKVCache
from inference_eval.engine.parallel.step_sync import HEAD, StepChannel, StepMessage
from inference_eval.engine.parallel.tp import parallelize, retie
from inference_eval.engine.target import (LoadedTarget, TargetConfig, _reset_rope, load_target,
                                          load_tokenizer, target_hf_dir)
from inference_eval.engine.threads import torch_threads


class TPLeader(nn.Module):
    """The leader's view of a parallelized model: broadcast the call, then run this rank's
    shard. `arch` is the rank's local arch (its KV heads size the engine's cache; the
    vocabulary stays global, since the lm_head gathers logits before sampling)."""

    compiled = None

    def __init__(self, model: TransformerLM, arch: ModelArch, channel: StepChannel) -> None:
        super().__init__()
        self.inner, self.arch, self.channel = model, arch, channel

    def forward(self, input_ids: torch.Tensor, plan, cache=None, *,
                logits_indices: torch.Tensor | None = None, compute_logits: bool = True,
                aux_layers: Sequence[int] = ()) -> ModelOutput:
        self.channel.send(StepMessage(input_ids, plan.layout, logits_indices, compute_logits,
                                      tuple(aux_layers)))
        return self.inner(input_ids, plan, cache, logits_indices=logits_indices,
                          compute_logits=compute_logits, aux_layers=aux_layers)


def tp_engine_config(cfg: EngineConfig) -> EngineConfig:
    """CUDA graphs replay the model without the leader's broadcast: off under TP."""
    return dataclasses.replace(cfg, cuda_graphs=False)


def follow(model: TransformerLM, arch: ModelArch, cfg: EngineConfig, channel: StepChannel,
           make_drafter: Callable | None = None) -> int:
    """A follower's loop: the same cache geometry and backend as the leader's LLMEngine
    builds from `cfg`, one model call per received message; returns the calls run.
    make_drafter(num_pages, page_size, device, dtype): this rank's drafter of a head split
    with the target (spec.ShardedHead.drafter), whose run() serves the leader's head calls."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    cpu_blas = cfg.cpu_blas == "numpy" or (
        cfg.cpu_blas == "auto" and device.type == "cpu" and dtype == torch.float32)
    set_cpu_blas(model, cpu_blas, codes=cfg.weight_codes)
    num_pages = cfg.resolve_num_pages(KVCache.bytes_per_token_for_arch(arch, dtype))
    cache = KVCache.for_arch(arch, num_pages, cfg.page_size, dtype, device)
    backend = make_backend(cfg.attention, device, dtype)
    drafter = None if make_drafter is None else make_drafter(num_pages, cfg.page_size, device,
                                                             dtype)
    if drafter is not None:  # the leader's engine binds its drafter the same way
        drafter.bind(backend, cpu_blas, cfg.weight_codes, cfg.head_code)
    calls = 0
    with torch_threads(openblas_threads(cpu_blas)), torch.inference_mode():
        while (msg := channel.recv()) is not None:
            if msg.moves is not None:  # the leader compacted its target cache before this call
                cache.copy_slots(*msg.moves)
            plan = None if msg.layout is None else backend.plan(msg.layout)
            if msg.model == HEAD:
                drafter.run(msg.input_ids, msg.state, plan, msg.logits_indices, msg.k)
            else:
                on = None if msg.layout.block_tables is None else cache  # cacheless: a packed prefill
                model(msg.input_ids, plan, on, logits_indices=msg.logits_indices,
                      compute_logits=msg.compute_logits, aux_layers=msg.aux_layers)
            calls += 1
    return calls


def load_tp_target(cfg: TargetConfig, tp: TPGroup,
                   with_tokenizer: bool = True,
                   expert_parallel: bool = False) -> tuple[LoadedTarget, ShardPlan]:
    """This rank's shard of the target. A checkpoint (hf, or gguf through its converted
    cache) is read slice by slice (loading.py); random targets (tests) are drawn whole, as
    at size 1, then sliced. The identity's fingerprints equal size 1's. expert_parallel:
    split a DeepSeek target's routed experts whole (engine.expert_parallel; shard.py)."""
    if cfg.source == "random":
        loaded = load_target(cfg, device=tp.device, with_tokenizer=with_tokenizer)
        return loaded, parallelize(loaded.model, tp, expert_parallel)
    from transformers import AutoConfig

    if dist.is_initialized() and dist.get_rank() != 0:
        dist.barrier()  # rank 0 converts a GGUF (or downloads) once; the others then read it
    hf_dir = target_hf_dir(cfg)
    if dist.is_initialized() and dist.get_rank() == 0:
        dist.barrier()
    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(hf_dir))
    check_arch(arch, tp.size, expert_parallel)  # before any allocation
    with torch.device("meta"):
        model = TransformerLM(arch)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    plan = parallelize(model, tp, expert_parallel)
    model = model.to_empty(device=tp.device)
    retie(model)
    _reset_rope(model)
    specs = plan.specs()
    load_sharded(model, arch, specs, hf_dir)
    if cfg.max_context:
        arch.max_position_embeddings = min(arch.max_position_embeddings, cfg.max_context)
    hashes = sharded_hashes(model, specs, shapes, tp)
    model = model.to(cfg.torch_dtype).eval().requires_grad_(False)
    retie(model)
    tok = load_tokenizer(cfg) if with_tokenizer else None
    if tok is not None and not arch.eos_token_ids and tok.eos_token_id is not None:
        arch.eos_token_ids = [tok.eos_token_id]
    identity = {"name": cfg.name, "source": cfg.source, "path": cfg.path,
                "arch": arch.to_dict(), **hashes}
    return LoadedTarget(model=model, tokenizer=tok, identity=identity, hf_dir=hf_dir), plan


@contextmanager
def serve(loaded: LoadedTarget, plan: ShardPlan, engine_cfg: EngineConfig, tp: TPGroup,
          build: Callable | None = None,
          make_drafter: Callable | None = None) -> Iterator[LLMEngine | None]:
    """An LLMEngine over a loaded shard on the replica's leader (None on followers, which
    serve the leader's steps before their body runs). Leaving the block stops the
    followers, also when the leader's body raised.

    build(model, channel, cfg) -> the leader's engine over `model` (a TPLeader; default
    LLMEngine), e.g. a speculative engine whose head drafter sends its calls on `channel`;
    make_drafter: the followers' side of that head (follow)."""
    cfg = tp_engine_config(engine_cfg)
    channel = StepChannel(tp)
    if not tp.is_leader:
        follow(loaded.model, plan.local_arch(), cfg, channel, make_drafter)
        yield None
        return
    leader = TPLeader(loaded.model, plan.local_arch(), channel)
    try:
        engine = (LLMEngine(leader, loaded.tokenizer, cfg) if build is None
                  else build(leader, channel, cfg))
        engine.cache = LeaderKVCache.of(engine.cache, channel)  # tree compaction reaches all
        yield engine
    except BaseException:
        with suppress(Exception):  # followers still up (the leader's own error) stop too
            channel.send(None)
        raise
    channel.send(None)


@contextmanager
def tensor_parallel_engine(target_cfg: TargetConfig,
                           engine_cfg: EngineConfig) -> Iterator[LLMEngine | None]:
    """Open the process groups (torchrun env), load this rank's shard, serve() it."""
    tp = init_tensor_parallel(engine_cfg.tensor_parallel, engine_cfg.device,
                              engine_cfg.tp_timeout_s)
    try:
        loaded, plan = load_tp_target(target_cfg, tp, with_tokenizer=tp.is_leader,
                                      expert_parallel=engine_cfg.expert_parallel)
        with serve(loaded, plan, engine_cfg, tp) as engine:
            yield engine
    finally:
        close_tensor_parallel()
