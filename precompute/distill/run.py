"""The distill job: prompts -> the target's answers through the engine -> conversations.jsonl.

Steps, each in its own module: prompts from data.load_prompts (precompute/data/), the plan
hash and manifest (manifest.py), what is already answered and the final merge (ledger.py over
the SIGKILL-safe logs of store.py), one batch turn by turn (answer.py); ranks and barriers
come from precompute/distributed.py.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import asdict
from pathlib import Path

from tqdm.auto import tqdm

from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.target import LoadedTarget, load_target
from precompute.data import Conversation, Turn, load_prompts
from precompute.distill.answer import answer_batch
from precompute.distill.config import DistillConfig
from precompute.distill.ledger import DistillLedger
from precompute.distill.manifest import DistillManifest, distill_plan_hash
from precompute.distributed import dist_info, process_group, rank_device
from precompute.identity import tokenizer_identity


def main(cfg: DistillConfig) -> DistillManifest | None:
    rank, world = dist_info()
    with process_group(world):
        return run_distill(cfg, rank, world)


def run_distill(cfg: DistillConfig, rank: int = 0, world: int = 1,
                loaded: LoadedTarget | None = None) -> DistillManifest | None:
    """Answer every prompt of cfg.data into cfg.output_dir; the manifest on rank 0, None on
    the other ranks. Resumes; a complete output of the same plan is returned untouched.
    loaded: the target when the caller (precompute, data.regenerate) has it already."""
    t_start = time.perf_counter()
    out = Path(cfg.output_dir)
    # Prompts first: a missing or unreadable input fails in seconds, not after loading a model.
    result = load_prompts(cfg.data)
    prompts = [_with_system(p, cfg.data.system_prompt) for p in result.conversations]
    if loaded is None:
        loaded = load_target(cfg.target, device=rank_device(cfg.engine.resolve_device(), world))
    tok = loaded.tokenizer
    if tok is None:
        raise ValueError(f"target {cfg.target.name!r} has no tokenizer; distill needs one")
    tok_id = tokenizer_identity(tok)
    phash = distill_plan_hash(loaded.identity, tok_id, asdict(cfg.sampling), cfg.turns,
                              cfg.engine.seed, cfg.target.dtype, prompts)
    ledger = DistillLedger(out, phash, prompts, rank, world)
    finished = ledger.open(cfg.overwrite)
    if finished is not None:  # a rerun after completion: nothing to do, files kept as they are
        return finished if rank == 0 else None
    batches = ledger.batches(cfg.engine.max_batch_size)
    todo = sum(len(b) for _, b in batches)
    print(f"distill[{rank}]: {len(ledger.mine()) - todo} of {len(ledger.mine())} prompts "
          f"already answered; answering {todo}")
    engine = LLMEngine(loaded.model, tok, cfg.engine)
    bar = tqdm(total=todo, unit="prompt", desc=f"distill[{rank}]", disable=not cfg.progress)
    t0, ntok = time.perf_counter(), 0
    for first, batch in batches:
        # Sampled runs reseed per batch, so a resumed run draws what an uninterrupted one does.
        engine.generator.manual_seed(_batch_seed(cfg.engine.seed, first))
        kept, rejected = answer_batch(engine, [prompts[i] for i in batch], cfg.sampling,
                                      cfg.turns, result.report.source)
        ledger.record(kept, rejected)
        ntok += sum(r["generated_tokens"] for r in kept + rejected)
        bar.update(len(batch))
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
        ledger.finish(manifest, result.rejected)
        _print_summary(out, manifest, time.perf_counter() - t_start)
    ledger.wait_for_all()  # the other ranks may read the merged files next (data.regenerate)
    return manifest


def _with_system(prompt: Conversation, system_prompt: str | None) -> Conversation:
    """The prompt with data.system_prompt as its system turn, when it has none of its own."""
    if system_prompt is None or (prompt.turns and prompt.turns[0].role == "system"):
        return prompt
    return Conversation(prompt.id, [Turn("system", system_prompt)] + prompt.turns)


def _batch_seed(seed: int, first: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{first}".encode()).digest()[:8], "little")


def _print_summary(out: Path, m: DistillManifest, secs: float) -> None:
    c = m.counts
    print(f"distill done: {c['kept']} conversations ({c['truncated']} cut at "
          f"max_new_tokens), rejected {sum(c['rejected'].values())} {c['rejected']}, "
          f"{m.generated_tokens} tokens generated, {secs:.1f}s -> {out}")
