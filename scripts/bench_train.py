"""Training step speed and memory: our step vs a naive full-logits step, same run.

Both variants run the trainer's step on the SmolLM2 `mtp` head (conf/head/mtp.yaml; frozen
embedding, final norm and lm_head from heads.frozen.load_frozen: V = 49152, H = 576):
head(batch) forward + backward, grad-norm clip, AdamW step (train.schedule.make_optimizer).
  ours : head(batch, chunk=--chunk), the chunked fused soft CE of heads/loss.py: draft
         logits, target probabilities and the gradient are formed `chunk` rows at a time and
         never kept; the step's metrics come out of the same pass.
  naive: head(batch, naive=True), soft_ce_reference: full [N, V] fp32 draft and target logits,
         log_softmax/softmax and autograd through them. This path also computes the metrics
         (top-1 match, sum min(p, q)) with a separate gradient-free chunked pass: two extra
         [N, H] x [H, V] matmuls (5 instead of 3) that a naive trainer reading its metrics off
         its own logits would not pay. So the JSON also has `loss_only_ratio`: soft_ce vs
         soft_ce_reference alone (forward + backward, no metrics on either side) on the same
         features, the part of the ratio that owes nothing to the metrics.
Same starting weights, batch (random by default: 4 packed sequences, --tokens in total, random
ids and hidden states; or the first sequences of a precompute output dir with --shards), fp32,
thread count, warm-up and step count.

Speed: one process builds both variants and alternates their steps (ours, naive, ours, ...),
so load from other processes on a shared machine hits both alike; tokens/s from the median
step time of each.

Memory: tracemalloc does not see torch's CPU allocations, so each variant also runs in a fresh
subprocess and the kernel's resident-set high-water mark is read: after setup and one warm-up
step (which also allocates AdamW's state) the process writes 5 to /proc/self/clear_refs, which
resets VmHWM to the current RSS, runs one step and reads VmHWM from /proc/self/status.
`*_step_peak_mb` = VmHWM - RSS before the step: what the step needs on top of what stays
resident (weights, optimizer state, batch). These subprocesses run with
MALLOC_MMAP_THRESHOLD_=65536 so that glibc returns every freed block >= 64 KiB to the kernel at
once (by default it raises that threshold up to 32 MiB as blocks are freed, and smaller blocks
then stay resident after free, so RSS would lag the live tensors). `*_proc_peak_mb` is the
whole process's VmHWM (imports and frozen parts included), for scale. Without /proc (not
Linux) the memory fields are null.

Ends with one JSON line: {"bench": "train", "ours_tok_s", "base_tok_s", "tok_s_ratio",
"ours_step_peak_mb", "base_step_peak_mb", "mem_ratio", ...}.
"""
from __future__ import annotations

import inference_eval  # noqa: F401  (first: its OpenBLAS setting must precede torch/numpy)

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _status_mb(field: str) -> float | None:
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
    """PackedBatch of exactly args.tokens tokens."""
    import torch

    from heads.batch import PackedBatch

    if args.shards:  # the first sequences of the shards, the last one cut to fit
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
    # The scale of a real residual stream (the final norm removes it anyway).
    return PackedBatch(torch.randint(0, vocab, (n,), generator=g),
                       4.0 * torch.randn(n, hidden, generator=g),
                       torch.rand(n, generator=g) > 0.2, lens)


class Trainer:
    """One variant's head, optimizer and step, as train/loop.py runs them (one process)."""

    def __init__(self, cfg, parts, naive: bool, chunk: int) -> None:
        import torch

        from heads.registry import build_head
        from train.schedule import make_optimizer

        self.head = build_head(cfg.head, parts, seed=0).float().train()
        self.params = [p for p in self.head.parameters() if p.requires_grad]
        self.opt = make_optimizer(self.params, cfg.optim)
        self.naive, self.chunk, self.clip = naive, chunk, cfg.optim.grad_clip
        self.torch = torch

    def step(self, batch) -> float:
        loss, _ = self.head(batch, chunk=self.chunk, naive=self.naive)
        loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


def setup(args):
    import torch

    from heads.frozen import load_frozen
    from inference_eval.hydra_app import compose
    from train.config import TrainConfig

    torch.set_num_threads(args.threads)
    cfg = compose("train", TrainConfig, ["target=smollm2", "head=mtp"])
    parts = load_frozen(cfg.target)
    return cfg, parts, make_batch(args, parts.arch.vocab_size, parts.arch.hidden_size)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run_speed(args) -> dict:
    """Both variants in this process, steps alternated; plus the loss-only comparison."""
    import torch

    from heads.loss import soft_ce, soft_ce_reference
    from heads.rollout import rollout

    cfg, parts, batch = setup(args)
    ours, naive = Trainer(cfg, parts, False, args.chunk), Trainer(cfg, parts, True, args.chunk)
    losses = {"ours": [], "naive": []}
    times = {"ours": [], "naive": []}
    for i in range(args.warmup + args.steps):
        for name, tr in (("ours", ours), ("naive", naive)):
            t = time.perf_counter()
            losses[name].append(tr.step(batch))
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t)

    # Loss alone, on the features of the (now trained) head: no rollout, no metrics pass.
    head = ours.head
    with torch.no_grad():
        out = rollout(head, batch)[0]
        y = head.frozen.norm(batch.hidden).index_select(0, out.index.label_rows)
    x = out.features.detach().requires_grad_(True)
    w, rw = head.frozen.weight, out.index.valid.float()
    loss_t = {"ours": [], "naive": []}
    fns = {"ours": lambda: soft_ce(x, w, y, w, rw, None, 1.0, args.chunk)[0].backward(),
           "naive": lambda: soft_ce_reference(x, w, y, w, rw).backward()}
    for _ in range(args.steps):
        for name, fn in fns.items():
            loss_t[name].append(timed(fn))
    n = batch.input_ids.numel()
    return {"tokens": n, "vocab": parts.arch.vocab_size, "hidden": parts.arch.hidden_size,
            "ours_step_s": statistics.median(times["ours"]),
            "base_step_s": statistics.median(times["naive"]),
            "ours_loss_s": statistics.median(loss_t["ours"]),
            "base_loss_s": statistics.median(loss_t["naive"]), "losses": losses}


def run_memory(args) -> dict:
    """One variant in a fresh process: warm-up step, reset VmHWM, one step, read VmHWM."""
    cfg, parts, batch = setup(args)
    tr = Trainer(cfg, parts, args.role == "mem-naive", args.chunk)
    tr.step(batch)
    before = _status_mb("VmRSS")
    reset = _reset_peak()
    tr.step(batch)
    peak = _status_mb("VmHWM")
    return {"step_peak_mb": peak - before if reset and peak is not None else None,
            "proc_peak_mb": peak, "rss_before_mb": before}


def spawn(args, role: str) -> dict:
    cmd = [sys.executable, __file__, "--role", role, "--tokens", str(args.tokens),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--chunk", str(args.chunk),
           "--threads", str(args.threads), "--seed", str(args.seed)]
    if args.shards:
        cmd += ["--shards", args.shards]
    env = dict(os.environ)
    if role.startswith("mem"):
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{role} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="packed tokens per step (N)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=1)
    # The trainer's default (1024) is sized for its 8192-token micro-batches; the ratio N/chunk
    # sets how much of the logits memory chunking saves, so keep it at 8 here too.
    ap.add_argument("--chunk", type=int, default=256, help="loss chunk (rows) of ours")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shards", default=None,
                    help="a SmolLM2 precompute output dir instead of random states")
    ap.add_argument("--role", default="main", choices=("main", "speed", "mem-ours", "mem-naive"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "speed":
        print(json.dumps(run_speed(args)))
        return
    if args.role.startswith("mem"):
        print(json.dumps(run_memory(args)))
        return
    sp = spawn(args, "speed")
    mo, mn = spawn(args, "mem-ours"), spawn(args, "mem-naive")
    lo, ln = sp["losses"]["ours"], sp["losses"]["naive"]
    if any(abs(a - b) > 1e-3 * abs(b) for a, b in zip(lo, ln)):  # one loss, two implementations
        sys.exit(f"losses differ: ours {lo} naive {ln}")
    n = sp["tokens"]
    print(json.dumps({
        "bench": "train", "target": "smollm2", "head": "mtp", "tokens": n, "vocab": sp["vocab"],
        "hidden": sp["hidden"], "steps": args.steps, "threads": args.threads,
        "chunk": args.chunk, "data": "shards" if args.shards else "random",
        "ours_tok_s": round(n / sp["ours_step_s"], 1), "base_tok_s": round(n / sp["base_step_s"], 1),
        "tok_s_ratio": round(sp["base_step_s"] / sp["ours_step_s"], 3),
        "loss_only_ratio": round(sp["base_loss_s"] / sp["ours_loss_s"], 3),
        "ours_step_peak_mb": _r(mo["step_peak_mb"]), "base_step_peak_mb": _r(mn["step_peak_mb"]),
        "mem_ratio": _ratio(mo["step_peak_mb"], mn["step_peak_mb"]),
        "ours_proc_peak_mb": _r(mo["proc_peak_mb"]), "base_proc_peak_mb": _r(mn["proc_peak_mb"]),
        "proc_mem_ratio": _ratio(mo["proc_peak_mb"], mn["proc_peak_mb"]),
        "full_logits_mb": round(n * sp["vocab"] * 4 / 2**20, 1),
        "losses": [round(x, 4) for x in lo]}))


def _r(x):
    return None if x is None else round(x, 1)


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else round(a / b, 3)


if __name__ == "__main__":
    main()
