"""Training step speed and memory: our step vs a naive full-logits step, same run.

Both variants run the trainer's step on the SmolLM2 `mtp` head (conf/head/mtp.yaml, frozen
embedding/final norm/lm_head from heads.frozen.load_frozen, V = 49152, H = 576):
head(batch) forward + backward, grad-norm clip, AdamW step (train.schedule.make_optimizer).
  ours : head(batch, chunk=trainer.loss_chunk) -- the chunked fused soft CE (heads/loss.py):
         logits, target probabilities and the gradient are formed `chunk` rows at a time and
         never kept; the metrics come from the same pass.
  naive: head(batch, naive=True) -- soft_ce_reference: full [N, V] fp32 draft and target
         logits, log_softmax/softmax and autograd through them. Note that this path also
         computes the step's metrics (top-1 match, sum min(p, q)) with a separate gradient-free
         chunked pass, i.e. two extra [N, H] x [H, V] matmuls a naive trainer that read its
         metrics off its own logits would not pay; `naive_metric_flops_share` in the JSON says
         how much of its matmul work that is, so the ratio can be read with that in mind.
Same batch (random by default: 4 packed sequences, --tokens in total, random ids and hidden
states; or the first sequences of a precompute output dir with --shards), same dtype (fp32),
thread count, warm-up and step count.

Memory. tracemalloc does not see torch's CPU allocations, so each variant runs in a fresh
subprocess and the kernel's resident-set high-water mark is read: after setup and the warm-up
step (which also allocates AdamW's state) the process writes 5 to /proc/self/clear_refs, which
resets VmHWM to the current RSS, then runs the timed steps and reads VmHWM from
/proc/self/status. `*_step_peak_mb` = VmHWM - RSS before the timed steps: the memory the step
needs on top of what stays resident (weights, optimizer state, batch). Both subprocesses run
with MALLOC_MMAP_THRESHOLD_=65536 so that glibc hands every freed block of >= 64 KiB back to
the kernel at once (its default raises the threshold up to 32 MiB as blocks are freed, and
blocks below that then stay resident after free, which would make RSS lag the live tensors).
`*_proc_peak_mb` is the whole process's VmHWM (imports and frozen parts included) for scale.
Without /proc (not Linux) the memory fields are null.

Ends with one JSON line: {"bench": "train", "ours_tok_s": ..., "base_tok_s": ...,
"tok_s_ratio": ..., "ours_step_peak_mb": ..., "base_step_peak_mb": ..., "mem_ratio": ...}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _rss_mb(field: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def make_batch(args, vocab: int, hidden: int):
    import torch

    from heads.rollout import PackedBatch

    if args.shards:  # the first sequences of the shards, the last one cut to fit --tokens
        from train.data import ShardStore

        store = ShardStore(args.shards)
        take, used = [], 0
        for i, ref in enumerate(store.seqs):
            if used >= args.tokens:
                break
            take.append(i)
            used += ref.end - ref.start
        full = store.collate(take)
        n = min(args.tokens, used)
        lens = full.seq_lens[:-1] + [full.seq_lens[-1] - (used - n)]
        return PackedBatch(full.input_ids[:n], full.hidden[:n], full.loss_mask[:n], lens)
    g = torch.Generator().manual_seed(args.seed)
    n = args.tokens
    lens = [n // 4] * 3 + [n - 3 * (n // 4)]
    # Hidden states with the scale of a real residual stream (the final norm removes it anyway).
    return PackedBatch(torch.randint(0, vocab, (n,), generator=g),
                       4.0 * torch.randn(n, hidden, generator=g),
                       torch.rand(n, generator=g) > 0.2, lens)


def run_variant(args) -> dict:
    """One variant in this process: setup, warm-up step, timed steps; returns its figures."""
    import torch

    from heads.frozen import load_frozen
    from heads.registry import build_head
    from inference_eval.hydra_app import compose
    from train.config import TrainConfig
    from train.schedule import make_optimizer

    torch.set_num_threads(args.threads)
    cfg = compose("train", TrainConfig, ["target=smollm2", "head=mtp",
                                         f"trainer.loss_chunk={args.chunk}"])
    parts = load_frozen(cfg.target)
    head = build_head(cfg.head, parts, seed=0).float().train()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = make_optimizer(params, cfg.optim)
    batch = make_batch(args, parts.arch.vocab_size, parts.arch.hidden_size)
    naive = args.variant == "naive"

    def step() -> float:
        loss, _ = head(batch, chunk=cfg.trainer.loss_chunk, naive=naive)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    losses = [step() for _ in range(args.warmup)]
    rss_before = _rss_mb("VmRSS")
    reset = _reset_peak()
    t = time.perf_counter()
    losses += [step() for _ in range(args.steps)]
    dt = time.perf_counter() - t
    peak = _rss_mb("VmHWM")
    return {"variant": args.variant, "tok_s": args.steps * batch.input_ids.numel() / dt,
            "step_s": dt / args.steps,
            "step_peak_mb": (peak - rss_before) if reset and peak is not None else None,
            "proc_peak_mb": peak if reset else _rss_mb("VmHWM"), "rss_before_mb": rss_before,
            "losses": losses, "tokens": batch.input_ids.numel(),
            "vocab": parts.arch.vocab_size, "hidden": parts.arch.hidden_size,
            "params": sum(p.numel() for p in params)}


def spawn(args, variant: str) -> dict:
    cmd = [sys.executable, __file__, "--variant", variant, "--tokens", str(args.tokens),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--chunk", str(args.chunk),
           "--threads", str(args.threads), "--seed", str(args.seed)]
    if args.shards:
        cmd += ["--shards", args.shards]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{variant} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="packed tokens per step")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=1024, help="trainer.loss_chunk of ours")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", default=None, help="a precompute output dir (SmolLM2) instead of random states")
    ap.add_argument("--variant", choices=("ours", "naive"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args)))
        return
    ours, base = spawn(args, "ours"), spawn(args, "naive")
    # Same starting weights and batch: the first loss must agree (the two losses are one).
    if abs(ours["losses"][0] - base["losses"][0]) > 1e-3 * abs(base["losses"][0]):
        sys.exit(f"losses differ: ours {ours['losses']} naive {base['losses']}")
    n, h, v = ours["tokens"], ours["hidden"], ours["vocab"]
    # [N, H] x [H, V] matmuls per step: ours 2 forward + 1 backward (grad w.r.t. the features);
    # naive 2 forward + 1 backward + 2 for its separately computed metrics.
    res = {"bench": "train", "target": "smollm2", "head": "mtp", "tokens": n, "vocab": v,
           "hidden": h, "steps": args.steps, "threads": args.threads, "chunk": args.chunk,
           "data": "shards" if args.shards else "random",
           "ours_tok_s": round(ours["tok_s"], 1), "base_tok_s": round(base["tok_s"], 1),
           "tok_s_ratio": round(ours["tok_s"] / base["tok_s"], 3),
           "ours_step_peak_mb": _r(ours["step_peak_mb"]), "base_step_peak_mb": _r(base["step_peak_mb"]),
           "mem_ratio": _ratio(ours["step_peak_mb"], base["step_peak_mb"]),
           "ours_proc_peak_mb": _r(ours["proc_peak_mb"]), "base_proc_peak_mb": _r(base["proc_peak_mb"]),
           "proc_mem_ratio": _ratio(ours["proc_peak_mb"], base["proc_peak_mb"]),
           "naive_metric_flops_share": round(2 / 5, 2),
           "logits_mb_full_fp32": round(n * v * 4 / 2**20, 1)}
    print(json.dumps(res))


def _r(x):
    return None if x is None else round(x, 1)


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else round(a / b, 3)


if __name__ == "__main__":
    main()
