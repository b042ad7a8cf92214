"""The distill job: prompts -> the target's answers through the engine -> conversations.jsonl.

Steps, each in its own module: prompts from data.load_prompts (precompute/data/), the plan
hash and manifest (manifest.py), what is already answered and the final merge (ledger.py over
the SIGKILL-safe logs of store.py), one batch turn by turn (answer.py); ranks and barriers
come from precompute/distributed.py, and under engine.tensor_parallel=T (world/T replicas as
the ranks, the leader's engine over the replica's shards) from precompute/tensor_parallel.py.
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

from tqdm.auto import tqdm

from inference_eval.engine.capture import CaptureSpec
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.target import LoadedTarget, load_target
from precompute.data import Conversation, Turn, load_prompts
from precompute.distill.answer import answer_batches
from precompute.distill.config import DistillConfig
from precompute.distill.ledger import DistillLedger
from precompute.capture import CapturedRecord, capture_dtype, captured_record
from precompute.config import aux_layer_ids
from precompute.distill.manifest import DistillManifest, distill_plan_hash
from precompute.distill.shards import CapturedShards, global_batches
from precompute.distributed import dist_info, process_group, rank_device
from precompute.identity import tokenizer_identity
from precompute.manifest import Manifest
from precompute.plan import plan_hash
from precompute.tensor_parallel import Replica, check_launch, run_replicated


def main(cfg: DistillConfig) -> DistillManifest | None:
    if cfg.engine.tensor_parallel > 1:
        check_launch(cfg.engine.tensor_parallel)
        return run_replicated(cfg.target, cfg.engine, cfg.engine, lambda replica: run_distill(
            cfg, replica.rank, replica.world, replica=replica))
    rank, world = dist_info()
    with process_group(world):
        return run_distill(cfg, rank, world)


def run_distill(cfg: DistillConfig, rank: int = 0, world: int = 1,
                loaded: LoadedTarget | None = None,
                replica: Replica | None = None) -> DistillManifest | None:
    """Answer every prompt of cfg.data into cfg.output_dir; the manifest on rank 0, None on
    the other ranks. Resumes; a complete output of the same plan is returned untouched.
    loaded: the target when the caller (precompute, data.regenerate) has it already.
    replica: this replica's leader under tensor parallelism (rank, world: the replica's)."""
    t_start = time.perf_counter()
    out = Path(cfg.output_dir)
    # Prompts first: a missing or unreadable input fails in seconds, not after loading a model.
    result = load_prompts(cfg.data)
    prompts = [_with_system(p, cfg.data.system_prompt) for p in result.conversations]
    if loaded is None and replica is not None:
        loaded = replica.load()
    elif loaded is None:
        loaded = load_target(cfg.target, device=rank_device(cfg.engine.resolve_device(), world))
    tok = loaded.tokenizer
    if tok is None:
        raise ValueError(f"target {cfg.target.name!r} has no tokenizer; distill needs one")
    tok_id = tokenizer_identity(tok)
    phash = distill_plan_hash(loaded.identity, tok_id, asdict(cfg.sampling), cfg.turns,
                              cfg.engine.seed, cfg.target.dtype, prompts)
    group = None if replica is None else replica.group
    ledger = DistillLedger(out, phash, prompts, rank, world, group=group)
    finished = ledger.open(cfg.overwrite)
    shards = _open_shards(cfg, loaded, phash, len(prompts), rank, world)
    if shards is not None and shards.complete:
        shards = None  # this plan's shards are all there already
    if finished is not None and shards is None:
        # a rerun after completion: nothing to do, files kept as they are
        return finished if rank == 0 else None
    batches = ledger.batches(cfg.engine.max_batch_size)
    if shards is not None:  # a batch without its shards runs again in full (shards.py)
        batches = [(first, full) for first, full in ledger.fixed_batches(cfg.engine.max_batch_size)
                   if shards.pending(first)]
    todo = sum(len(b) for _, b in batches)
    print(f"distill[{rank}]: {len(ledger.mine()) - todo} of {len(ledger.mine())} prompts "
          f"already answered; answering {todo}")
    capture = None if shards is None else CaptureSpec(shards.aux_layers,
                                                      capture_dtype(cfg.hidden_dtype))
    bar = tqdm(total=todo, unit="prompt", desc=f"distill[{rank}]", disable=not cfg.progress)
    t0, ntok = time.perf_counter(), 0
    # Under tensor parallelism the engine's calls run on the followers too, until the block
    # ends (before the barriers below, which only the leaders join).
    with nullcontext(loaded) if replica is None else replica.serve(loaded) as running:
        engine = LLMEngine(running.model, tok, cfg.engine if replica is None else replica.engine,
                           capture=capture)
        for first, kept, rejected, last in answer_batches(
                engine, prompts, batches, cfg.sampling, cfg.turns, result.report.source,
                cfg.engine.seed, keep_last=shards is not None):
            if finished is None:  # answers already logged are not logged twice
                ledger.record([r for r in kept if r["id"] not in ledger.done],
                              [r for r in rejected if r["id"] not in ledger.done])
            if shards is not None:
                shards.write(first, *records_of(tok, kept, last, cfg.data.max_length))
            ntok += sum(r["generated_tokens"] for r in kept + rejected)
            bar.update(len(kept) + len(rejected))
            bar.set_postfix(tok_s=f"{ntok / max(time.perf_counter() - t0, 1e-9):.1f}")
    bar.close()
    ledger.wait_for_all()
    manifest = None
    if rank == 0:
        manifest = DistillManifest(
            plan_hash=phash, target={k: loaded.identity[k] for k in
                                     ("name", "source", "path", "arch", "weights_sha256")},
            tokenizer=tok_id, sampling=asdict(cfg.sampling), turns=cfg.turns,
            data={"config": asdict(cfg.data), "load_report": result.report.to_dict()},
            num_prompts=len(prompts), batch_size=cfg.engine.max_batch_size, world_size=world)
        if finished is None:
            ledger.finish(manifest, result.rejected)
            _print_summary(out, manifest, time.perf_counter() - t_start)
        else:
            manifest = finished
        if shards is not None:
            shards.finish(_shard_manifest(cfg, loaded, tok_id, shards, manifest))
    ledger.wait_for_all()  # the other ranks may read the merged files next (data.regenerate)
    return manifest


def records_of(tok, kept: list[dict], last: dict, max_length: int
               ) -> tuple[list[CapturedRecord], list[dict]]:
    """(records, rejects {"id", "reason", "detail"}) of one batch's kept conversations."""
    records, rejects = [], []
    for row in kept:
        messages, res = last[row["id"]]
        got = captured_record(tok, row["id"], messages, res, max_length)
        if isinstance(got, CapturedRecord):
            records.append(got)
        else:
            rejects.append({"id": got.id, "reason": got.reason, "detail": got.detail})
    return records, rejects


def _open_shards(cfg: DistillConfig, loaded: LoadedTarget, phash: str, num_prompts: int,
                 rank: int, world: int) -> CapturedShards | None:
    """The shard writer of cfg.shards_dir (None without one); `.complete` when that
    directory already holds this plan's complete shards."""
    if cfg.shards_dir is None:
        return None
    arch = loaded.model.arch
    aux = aux_layer_ids(cfg.aux, arch.num_layers)
    # The states depend on how requests were batched: batch size and ranks are in the plan.
    shash = plan_hash({"answers": phash, "hidden_dtype": cfg.hidden_dtype, "aux": aux,
                       "max_length": cfg.data.max_length, "shard_tokens": cfg.shard_tokens,
                       "batch_size": cfg.engine.max_batch_size, "world": world})
    firsts = global_batches(num_prompts, world, cfg.engine.max_batch_size)
    shards = CapturedShards(Path(cfg.shards_dir), shash, firsts, rank, cfg.hidden_dtype,
                            cfg.shard_tokens)
    shards.aux_layers = aux
    shards.complete = shards.open(cfg.overwrite) is not None
    return shards


def _shard_manifest(cfg: DistillConfig, loaded: LoadedTarget, tok_id: dict,
                    shards: CapturedShards, m: DistillManifest) -> Manifest:
    arch = loaded.model.arch
    return Manifest(
        target={k: loaded.identity[k] for k in ("name", "source", "path", "arch",
                                                "weights_sha256")},
        tokenizer=tok_id, hidden_dtype=cfg.hidden_dtype, hidden_size=arch.hidden_size,
        aux_layers=list(shards.aux_layers), plan_hash=shards.plan_hash, num_planned_shards=0,
        data={"config": asdict(cfg.data),
              "load_report": {"source": m.data["load_report"].get("source"),
                              "rejected": dict(m.counts.get("rejected", {}))},
              "regeneration": {"distill_dir": cfg.output_dir, "plan_hash": m.plan_hash,
                               "turns": m.turns, "sampling": m.sampling, "counts": m.counts,
                               "generated_tokens": m.generated_tokens, "captured": True},
              "max_length": cfg.data.max_length})


def _with_system(prompt: Conversation, system_prompt: str | None) -> Conversation:
    """The prompt with data.system_prompt as its system turn, when it has none of its own."""
    if system_prompt is None or (prompt.turns and prompt.turns[0].role == "system"):
        return prompt
    return Conversation(prompt.id, [Turn("system", system_prompt)] + prompt.turns)


def _print_summary(out: Path, m: DistillManifest, secs: float) -> None:
    c = m.counts
    print(f"distill done: {c['kept']} conversations ({c['truncated']} cut at "
          f"max_new_tokens), rejected {sum(c['rejected'].values())} {c['rejected']}, "
          f"{m.generated_tokens} tokens generated, {secs:.1f}s -> {out}")
