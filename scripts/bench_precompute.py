"""Hidden-state dump speed and size: our precompute path vs the EAGLE/SpecForge recipe, same run.

Both sides get the same conversations (the first --limit ShareGPT chats, chat-templated and
loss-masked by precompute/data), the same target weights (SmolLM2 by default), dtype and
thread count.
- ours: `build_shard` (length-sorted packed batches of <= --batch-tokens tokens, the engine's
  model with the OpenBLAS CPU path, lm_head skipped), then `write_shard` (bf16, last hidden
  only); bytes per token are measured on the written file.
- base: what EAGLE's ge_data and SpecForge's prepare_hidden_states do: transformers'
  AutoModelForCausalLM forward with output_hidden_states=True on right-padded batches in
  dataset order, copying hidden_states[-1] of the real tokens out as bf16. Its batch size is
  ours on average (records / our batches), unless --base-batch-size says otherwise.
The records are cut into --groups contiguous groups (like shards); each group runs on both
sides back to back, alternating which goes first, so load from other users of a shared
machine falls on both alike.
The roofline: the same run times, on the target's own layer shapes at --batch-tokens rows,
the machine's fp32 GEMM through each path precompute can use (the engine's kernel,
cpu_linear, and OpenBLAS via numpy), takes the faster, and divides
it into the model's matmul FLOPs per token (2 x the layer weights, plus attention's
4 x layers x hidden x mean context); ours is reported as a fraction of that. --split dumps
the first group once more with timers on the products and on attention and prints the time
split (products with their GFLOP/s inside the dump, attention, the rest).
Ends with one JSON line: {"bench": "precompute", "ours_tok_s", "base_tok_s", "ratio",
"roofline_tok_s", "fraction_of_roofline", "gemm_gflops", "bytes_per_token",
"bytes_budget": 2*H+8, ...}.
"""
from __future__ import annotations

import inference_eval  # noqa: F401  (first: its OpenBLAS setting must precede torch/numpy)

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

import precompute.dump as dump
from inference_eval.engine.attention import make_backend
from inference_eval.engine.model import cpu_linear
from inference_eval.engine.model.linear import set_cpu_blas
from inference_eval.engine.target import TargetConfig, load_target
from precompute.data import DataConfig, load_conversations, tokenize_conversations
from precompute.plan import plan_batches
from precompute.shard_io import write_shard


def gemm_roofline(model, rows: int, reps: int = 3) -> dict[str, float]:
    """GFLOP/s of fp32 products [rows, in] x [in, out] over one layer's weights, through each
    path the dump can take: the engine's kernel (cpu_linear, when built; timed first, see
    cpu_linear.time_paths) and OpenBLAS (numpy)."""
    import numpy as np

    layer = model.layers[0]
    weights = [m.weight.detach().contiguous() for m in layer.modules()
               if isinstance(m, torch.nn.Linear)]
    rng = np.random.default_rng(0)
    pairs = [(torch.from_numpy(rng.standard_normal((rows, w.shape[1]), np.float32)), w)
             for w in weights]
    flops = sum(2 * rows * w.shape[0] * w.shape[1] for w in weights)
    secs = cpu_linear.time_paths({"layer": pairs}, reps + 1)
    return {name: flops / by_case["layer"] / 1e9 for name, by_case in secs.items()}


def flops_per_token(model, mean_context: float) -> float:
    """Matmul FLOPs of one token through every layer (lm_head skipped, as precompute does)."""
    a = model.arch
    per_layer = sum(2 * m.weight.numel() for m in model.layers[0].modules()
                    if isinstance(m, torch.nn.Linear))
    attn = 4 * a.num_heads * a.head_dim * mean_context  # q.k and p.v over the context
    return a.num_layers * (per_layer + attn)


def ours(model, records, batch_tokens: int) -> tuple[float, object]:
    backend = make_backend("torch", "cpu")
    t = time.perf_counter()
    shard = dump.build_shard(model, backend, records, batch_tokens=batch_tokens, aux_layers=[],
                             hidden_dtype="bfloat16")
    return time.perf_counter() - t, shard


@torch.inference_mode()
def base(hf, records, batch_size: int, pad_id: int) -> float:
    t = time.perf_counter()
    for s in range(0, len(records), batch_size):
        batch = [r.input_ids for r in records[s:s + batch_size]]
        width = max(map(len, batch))
        ids = torch.tensor([x + [pad_id] * (width - len(x)) for x in batch])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in batch])
        out = hf(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        last = out.hidden_states[-1]
        kept = [last[b, :len(x)].to(torch.bfloat16).clone() for b, x in enumerate(batch)]
        del out, last, kept
    return time.perf_counter() - t


def threads_check(model, records, batch_tokens: int) -> dict[str, float]:
    """tok/s of build_shard with dump.py's thread setting (torch at 1 thread where OpenBLAS
    runs products, see linear.openblas_threads) and at the process default (dump's thread
    switch disabled), on the same records."""
    res = {}
    tokens = sum(len(r.input_ids) for r in records)
    secs, _ = ours(model, records, batch_tokens)
    res["dump_setting"] = round(tokens / secs, 1)
    with mock.patch.object(dump, "torch_threads", lambda n: contextlib.nullcontext()):
        secs, _ = ours(model, records, batch_tokens)
    res[f"torch_threads_{torch.get_num_threads()}"] = round(tokens / secs, 1)
    return res


def time_split(model, records, batch_tokens: int) -> dict[str, float]:
    """Where the dump's time goes: seconds in the products (linear.matmul_wt: the kernel or
    OpenBLAS, and their GFLOP/s), in attention (the backend's causal path), and the rest
    (norms, rope, SwiGLU, residuals, copies), over one more dump of `records` with timers
    around both."""
    import inference_eval.engine.attention.torch_backend as tb
    import inference_eval.engine.model.linear as lin

    acc = {"gemm_s": 0.0, "attention_s": 0.0, "gemm_flops": 0.0}

    def timed(fn, key):
        def run(*args):
            t = time.perf_counter()
            y = fn(*args)
            acc[key] += time.perf_counter() - t
            return y
        return run

    gemm = timed(lin.matmul_wt, "gemm_s")

    def mm(x, w, fast, bias=None, packed=None):  # x [M, in] @ w[out, in].T
        acc["gemm_flops"] += 2 * x.shape[0] * w.shape[0] * w.shape[1]
        return gemm(x, w, fast, bias, packed)

    with mock.patch.object(lin, "matmul_wt", mm), mock.patch.object(
            tb.TorchAttentionPlan, "_attend_causal",
            timed(tb.TorchAttentionPlan._attend_causal, "attention_s")):
        total, _ = ours(model, records, batch_tokens)
    return {"total_s": round(total, 4), "gemm_s": round(acc["gemm_s"], 4),
            "gemm_flops": int(acc["gemm_flops"]),
            "gemm_gflops_in_dump": round(acc["gemm_flops"] / max(acc["gemm_s"], 1e-9) / 1e9, 1),
            "attention_s": round(acc["attention_s"], 4),
            "other_s": round(total - acc["gemm_s"] - acc["attention_s"], 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=64, help="first N ShareGPT conversations")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--base-batch-size", type=int, default=None)
    ap.add_argument("--groups", type=int, default=4, help="contiguous record groups (shards)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads-check", type=int, default=0,
                    help="also time build_shard with torch at 1 vs --threads threads on the "
                         "first N records")
    ap.add_argument("--split", action="store_true",
                    help="after the timed runs, dump the first group once more with timers on "
                         "the products and attention, and print the time split")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    loaded = load_target(TargetConfig(dtype=args.dtype))
    model, tok = loaded.model, loaded.tokenizer
    set_cpu_blas(model, args.dtype == "float32", codes=False)  # what run.py does on CPU fp32
    hf = AutoModelForCausalLM.from_pretrained(loaded.hf_dir,
                                              dtype=model.lm_head_weight.dtype).eval()
    data = load_conversations(DataConfig(limit=args.limit))
    records = list(tokenize_conversations(tok, data.conversations, args.max_length))
    tokens = sum(len(r.input_ids) for r in records)
    size = -(-len(records) // args.groups)
    groups = [records[i:i + size] for i in range(0, len(records), size)]
    n_batches = sum(len(plan_batches(range(len(g)), [len(r.input_ids) for r in g],
                                     args.batch_tokens)) for g in groups)
    bs = args.base_batch_size or max(1, round(len(records) / n_batches))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    print(f"{len(records)} records, {tokens} tokens in {len(groups)} groups; ours: {n_batches} "
          f"packed batches of <= {args.batch_tokens} tokens; base: batches of {bs}; "
          f"{args.threads} threads, {args.dtype}", flush=True)

    warm = records[-2:]  # short warm-up on both sides (allocators, OpenBLAS threads)
    ours(model, warm, args.batch_tokens)
    base(hf, warm, bs, pad)
    extra = {}
    if args.threads_check:
        extra["threads_check_tok_s"] = threads_check(model, records[:args.threads_check],
                                                     args.batch_tokens)
        print("threads check:", extra["threads_check_tok_s"], flush=True)
    secs_ours = secs_base = 0.0
    nbytes = 0
    with tempfile.TemporaryDirectory() as d:
        for g, recs in enumerate(groups):
            n = sum(len(r.input_ids) for r in recs)
            for side in ("ours", "base") if g % 2 == 0 else ("base", "ours"):
                if side == "ours":
                    secs, shard = ours(model, recs, args.batch_tokens)
                    secs_ours += secs
                    path = Path(d) / f"shard_{g:05d}.safetensors"
                    write_shard(path, shard)
                    nbytes += path.stat().st_size
                else:
                    secs = base(hf, recs, bs, pad)
                    secs_base += secs
                print(f"group {g + 1}/{len(groups)} {side}: {n / secs:.1f} tok/s ({secs:.1f} s)",
                      flush=True)
    print(f"ours: {tokens / secs_ours:.1f} tok/s ({secs_ours:.1f} s); "
          f"base: {tokens / secs_base:.1f} tok/s ({secs_base:.1f} s)", flush=True)
    with torch.inference_mode():
        by_path = gemm_roofline(model, args.batch_tokens)
    gflops = max(by_path.values())  # the fastest fp32 GEMM this machine has for these shapes
    # Causal attention: a token attends to half its sequence on average.
    ctx = sum(len(r.input_ids) ** 2 for r in records) / (2 * tokens)
    roof = gflops * 1e9 / flops_per_token(model, ctx)
    paths = ", ".join(f"{k} {v:.1f}" for k, v in by_path.items())
    print(f"roofline: {gflops:.1f} GFLOP/s, the faster fp32 GEMM on the layer shapes ({paths}) "
          f"-> {roof:.1f} tok/s; ours at {tokens / secs_ours / roof:.0%} of it", flush=True)
    extra["gemm_gflops_by_path"] = {k: round(v, 1) for k, v in by_path.items()}
    if args.split:
        extra["split"] = time_split(model, groups[0], args.batch_tokens)
        sp = extra["split"]
        print(f"split of one more dump of group 1 ({sp['total_s']} s): products {sp['gemm_s']} s "
              f"({sp['gemm_gflops_in_dump']} GFLOP/s), attention {sp['attention_s']} s, "
              f"the rest {sp['other_s']} s", flush=True)
    h = model.arch.hidden_size
    print(json.dumps({
        "bench": "precompute", "ours_tok_s": round(tokens / secs_ours, 1),
        "base_tok_s": round(tokens / secs_base, 1), "ratio": round(secs_base / secs_ours, 2),
        "roofline_tok_s": round(roof, 1), "fraction_of_roofline": round(tokens / secs_ours / roof, 3),
        "gemm_gflops": round(gflops, 1),
        "bytes_per_token": round(nbytes / tokens, 2), "bytes_budget": 2 * h + 8,
        "tokens": tokens, "records": len(records), "groups": len(groups), "base_batch_size": bs,
        "batch_tokens": args.batch_tokens, "threads": args.threads, "dtype": args.dtype, **extra}))


if __name__ == "__main__":
    main()
