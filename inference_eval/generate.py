"""`python -m inference_eval.generate`: autoregressive generation on the engine.

    python -m inference_eval.generate prompts='["Write a haiku about caches."]'
    python -m inference_eval.generate prompts_file=prompts.jsonl output=out.jsonl \
        sampling.temperature=0.7 sampling.max_new_tokens=256
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.hydra_app import run_cli
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.target import TargetConfig, load_target


@dataclass
class GenerateConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompts: list[str] = field(default_factory=list)
    # .txt (one prompt per line) or .jsonl ({"prompt"} or {"messages"} per line)
    prompts_file: str | None = None
    chat: bool = True
    output: str | None = None

    def __post_init__(self) -> None:
        if not self.prompts and not self.prompts_file:
            raise ValueError("give prompts=[...] or prompts_file=FILE")


def read_prompts(path: str) -> list:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompts_file {p} does not exist; check prompts_file")
    if p.suffix != ".jsonl":
        return [line for line in p.read_text().splitlines() if line.strip()]
    out = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}:{n}: not valid JSON ({exc.msg})") from None
        if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
            out.append(rec["prompt"])
        elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
            out.append(rec["messages"])
        else:
            raise ValueError(f"{p}:{n}: expected a 'prompt' string or a 'messages' list")
    return out


def main(cfg: GenerateConfig) -> list:
    # Prompts first: a bad line fails in a second, not after loading the target.
    prompts = list(cfg.prompts) + (read_prompts(cfg.prompts_file) if cfg.prompts_file else [])
    if cfg.engine.tensor_parallel > 1:
        return _main_tensor_parallel(cfg, prompts)
    loaded = load_target(cfg.target, device=cfg.engine.resolve_device())
    engine = LLMEngine(loaded.model, loaded.tokenizer, cfg.engine)
    results, dt = _generate(engine, prompts, cfg)
    _write(results, dt, engine.num_steps, cfg)
    return results


def _main_tensor_parallel(cfg: GenerateConfig, prompts: list) -> list:
    """Under torchrun: world / T replicas each generate every replicas-th prompt (replicas.py);
    global rank 0 prints and writes all results in prompt order, every other rank returns []."""
    from inference_eval.engine.parallel.group import close_tensor_parallel, init_tensor_parallel
    from inference_eval.engine.parallel.replicas import (gather_to_first, leaders_group, share,
                                                         unshare)
    from inference_eval.engine.parallel.runner import load_tp_target, serve

    tp = init_tensor_parallel(cfg.engine.tensor_parallel, cfg.engine.device,
                              cfg.engine.tp_timeout_s)
    parts = None
    try:
        leaders = leaders_group(tp)
        mine = share(prompts, tp, "prompts")
        loaded, plan = load_tp_target(cfg.target, tp, with_tokenizer=tp.is_leader,
                                      expert_parallel=cfg.engine.expert_parallel)
        with serve(loaded, plan, cfg.engine, tp) as engine:
            if engine is not None:
                results, dt = _generate(engine, mine, cfg)
                parts = gather_to_first((results, dt, engine.num_steps), tp, leaders)
    finally:
        close_tensor_parallel()
    if parts is None:
        return []
    results = unshare([p[0] for p in parts])
    for i, r in enumerate(results):
        r.id = i  # ids were per replica
    # The replicas ran side by side: the slowest one's time; the steps of all.
    _write(results, max(p[1] for p in parts), sum(p[2] for p in parts), cfg)
    return results


def _generate(engine: LLMEngine, prompts: list, cfg: GenerateConfig) -> tuple[list, float]:
    t0 = time.perf_counter()
    results = engine.generate(prompts, cfg.sampling, chat=cfg.chat)
    return results, time.perf_counter() - t0


def _write(results: list, dt: float, steps: int, cfg: GenerateConfig) -> None:
    ntok = sum(len(r.token_ids) for r in results)
    for r in results:
        head = f"--- prompt {r.id} ({r.finish_reason}, {len(r.token_ids)} tokens)"
        print(head if r.error is None else f"{head}: {r.error}")
        if r.text:
            print(r.text)
    print(f"generated {ntok} tokens for {len(results)} prompts in {dt:.1f}s "
          f"({ntok / max(dt, 1e-9):.1f} tok/s, {steps} engine steps)")
    if cfg.output:
        with open(cfg.output, "w") as f:
            for r in results:
                f.write(json.dumps(asdict(r)) + "\n")
        print(f"wrote {cfg.output}")


if __name__ == "__main__":
    run_cli("generate", GenerateConfig, main)
