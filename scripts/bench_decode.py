"""Autoregressive decode speed: our engine vs transformers' `generate`, same run.

Same target weights (SmolLM2 by default), dtype, thread count, prompts and token counts;
greedy with eos ignored so both produce exactly --new-tokens per prompt. Ours reads its
small-row products from the weights' exact GGUF block code where the target has one
(engine.weight_codes: the same fp32 weights transformers multiplies, from a shorter stream);
--no-weight-codes reads the fp32 copy instead. On a GPU with FlashInfer (bf16/fp16) our
decode steps replay as CUDA graphs, and the same engine without them is timed as well
(`ours_no_graphs_tok_s_bs*`, `graphs_gain_bs*`). Each side runs every
batch size --reps times (its own runs back to back, see below); tokens/s is the median over
them, the best beside it, and the ratio compares medians, so one slow spell of the machine
does not decide it. Ends with one JSON line: {"bench": "decode", "ours_tok_s_bs1": ...,
"base_tok_s_bs1": ..., "ratio_bs1": ..., "ours_best_tok_s_bs1": ..., ...}.
"""
from __future__ import annotations

import inference_eval  # noqa: F401  (first: its OpenBLAS setting must precede torch/numpy)

import argparse
import json
import statistics
import time

import torch

from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.target import TargetConfig, load_target

PROMPTS = [
    "Write a python function that checks whether a number is prime.",
    "What is the capital of France? Answer in one sentence.",
    "Tell me a short story about a robot learning to paint.",
    "Explain how a hash map works.",
    "List five tips for writing clean code.",
    "How do I read a CSV file in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "What are the benefits of unit testing?",
]


def hf_generate(hf, tok, batch_ids: list[list[int]], n: int) -> int:
    """Left-padded batched greedy generate; returns tokens produced."""
    width = max(map(len, batch_ids))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch_ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch_ids])
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                      pad_token_id=pad)
    return (out.shape[1] - width) * len(batch_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per side and batch size")
    ap.add_argument("--no-weight-codes", action="store_true",
                    help="products from the fp32 weights, not their GGUF block code")
    ap.add_argument("--compile", action="store_true",
                    help="engine.compile: inductor-compiled decode steps (compiled before timing)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    loaded = load_target(TargetConfig(dtype=args.dtype), device=args.device)
    tok = loaded.tokenizer
    hf = AutoModelForCausalLM.from_pretrained(loaded.hf_dir, dtype=loaded.model.lm_head_weight.dtype)
    hf = hf.to(args.device).eval()
    hf.generation_config.eos_token_id = None  # both sides produce exactly n tokens
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"] for p in PROMPTS]
    n = args.new_tokens
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    def engine(graphs: bool) -> LLMEngine:
        return LLMEngine(loaded.model, tok, EngineConfig(
            attention=args.attention, device=args.device, compile=args.compile,
            weight_codes=not args.no_weight_codes, cuda_graphs=graphs))

    eng = engine(True)
    for bs in (1, 8):
        eng.warm(bs)  # engine.compile: rows 1 and 8, outside the timing
    # With CUDA graphs (FlashInfer on a GPU) the same engine without them runs too, so the
    # graphs' share of the speed is a same-run ratio.
    eager = engine(False) if eng.backend.graphs is not None else None

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    def timed(fn) -> tuple[float, int]:
        sync()
        t = time.perf_counter()
        toks = fn()
        sync()
        return time.perf_counter() - t, toks

    def tokens(e: LLMEngine, group: list[list[int]]) -> int:
        return sum(len(r.token_ids) for r in e.generate(group, params, progress=False))

    def rates(run, groups: list[list[list[int]]]) -> list[float]:
        """tokens/s of each of --reps runs of `run` over all groups."""
        out = []
        for _ in range(args.reps):
            dt = n_tok = 0
            for g in groups:
                t, k = timed(lambda: run(g))  # noqa: B023  (called at once)
                dt, n_tok = dt + t, n_tok + k
            out.append(n_tok / dt)
        return out

    with torch.inference_mode():
        for e in (eng, eager):  # warm-up; captures the batch-1 and batch-8 decode graphs
            for g in (ids[:1], ids):
                if e is not None:
                    e.generate(g, SamplingParams(max_new_tokens=4), progress=False)
        hf_generate(hf, tok, ids[:2], 4)
        res = {}
        for bs, groups in ((1, [[x] for x in ids[:4]]), (8, [ids])):
            if eager is not None:
                slow = rates(lambda g: tokens(eager, g), groups)
                res[f"ours_no_graphs_tok_s_bs{bs}"] = round(statistics.median(slow), 2)
            # Each side runs all its groups back to back: interleaving the two thread pools
            # (ours: OpenBLAS, transformers: OpenMP) makes whichever runs second pay for the
            # other's spinning workers.
            ours = rates(lambda g: tokens(eng, g), groups)
            base = rates(lambda g: hf_generate(hf, tok, g, n), groups)
            res[f"ours_tok_s_bs{bs}"] = round(statistics.median(ours), 2)
            res[f"base_tok_s_bs{bs}"] = round(statistics.median(base), 2)
            res[f"ratio_bs{bs}"] = round(statistics.median(ours) / statistics.median(base), 3)
            res[f"ours_best_tok_s_bs{bs}"] = round(max(ours), 2)
            res[f"base_best_tok_s_bs{bs}"] = round(max(base), 2)
            if eager is not None:
                res[f"graphs_gain_bs{bs}"] = round(statistics.median(ours) / statistics.median(slow), 3)
    print(json.dumps({"bench": "decode", "target": loaded.identity["name"], "device": args.device,
                      "dtype": args.dtype, "threads": args.threads, "new_tokens": n,
                      "compile": args.compile, "weight_codes": not args.no_weight_codes,
                      "reps": args.reps, **res}))


if __name__ == "__main__":
    main()
