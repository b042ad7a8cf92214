"""Cross-engine check: does an exported EAGLE-3 head accept in vLLM what it accepts here?

Three steps, two virtual environments (vLLM pins its own torch, so it never enters .venv):

    .venv/bin/python scripts/check_vllm.py ours --head runs/head --out runs/vllm_check/cmp
    /work/vllm-venv/bin/python scripts/check_vllm.py vllm --out runs/vllm_check/cmp
    .venv/bin/python scripts/check_vllm.py compare --out runs/vllm_check/cmp

`ours` exports the head (`python -m train.export --format eagle3`), materializes the target
as an HF directory, encodes the prompts to token ids and decodes them greedily with a chain of
K drafts of the EXPORTED head on our engine, so both engines serve the same file. `vllm`
feeds vLLM the same token ids (no template on its side can differ) with
speculative_config={"method": "eagle3", ...}. `compare` prints τ and α_k side by side and how
many greedy outputs differ, then one JSON line. scripts/check_vllm.sh runs all three.

Both sides are reduced to the same counters (rounds that proposed drafts, drafts proposed,
drafts accepted per position), the ones vLLM's V1 metrics expose, and one function turns
counters into τ = 1 + accepted / rounds (tokens per verification round, bonus included) and
α_k = accepted at k / rounds that reached k. Our engine's own τ (inference_eval/evaluation/
metrics.py) is reported beside it: it also counts the rounds that proposed nothing (one token
left before max_new_tokens). vLLM drafts K in every round, so ITS τ and α_k line up with our
engine's own τ; on SmolLM2, K=3, 12 prompts they were equal to the last digit.
The vllm side imports nothing from this repository and nothing heavy at module level.
"""
from __future__ import annotations

import inference_eval  # noqa: F401  (first: its OpenBLAS setting must precede torch/numpy)

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

# Exit status of the vllm side when vLLM cannot run EAGLE-3 here (not a crash: a limitation).
UNSUPPORTED = 3


def counters_from_steps(proposed: Sequence[int], accepted: Sequence[int],
                        k: int) -> dict[str, Any]:
    """Per-round (proposed, accepted) [S] ints -> vLLM-style counters. Rounds that proposed
    nothing (prefills, a request's last token) are not drafts, as in vLLM."""
    rounds = [(p, a) for p, a in zip(proposed, accepted) if p > 0]
    return {"num_drafts": len(rounds), "num_draft_tokens": sum(p for p, _ in rounds),
            "num_accepted_tokens": sum(a for _, a in rounds),
            "accepted_per_pos": [sum(a >= j for _, a in rounds) for j in range(1, k + 1)],
            # attempted_per_pos is known exactly here; vLLM's counters only imply it.
            "attempted_per_pos": [sum(p >= j and a >= j - 1 for p, a in rounds)
                                  for j in range(1, k + 1)]}


def rates_from_counters(c: dict[str, Any], k: int) -> dict[str, Any]:
    """τ and conditional α_k [K] from counters.

    vLLM counts accepted_per_pos[j] = rounds whose draft j+1 was accepted; acceptance is a
    prefix, so the rounds that reached position j+1 are accepted_per_pos[j-1] (num_drafts at
    j = 0) when every round proposed K drafts. `exact` says whether that held (or whether
    attempted_per_pos was measured)."""
    n, acc = c["num_drafts"], list(c["accepted_per_pos"])[:k]
    acc += [0] * (k - len(acc))
    attempted = c.get("attempted_per_pos") or [n] + acc[:-1]
    exact = "attempted_per_pos" in c or c["num_draft_tokens"] == n * k
    return {"tau": 1 + c["num_accepted_tokens"] / n if n else None,
            "alpha": [a / t if t else None for a, t in zip(acc, attempted)],
            "num_drafts": n, "exact": exact}


def compare_outputs(ours: Sequence[Sequence[int]],
                    theirs: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
    """[{"index", "at"}] for every prompt whose token ids differ ("at": first differing
    index, or the shorter length when one is a prefix of the other)."""
    bad = []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if list(a) != list(b):
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            bad.append({"index": i, "at": at})
    return bad


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(k: int, sides: dict[str, dict[str, Any]]) -> str:
    """Side-by-side rows: τ (counters), rounds, accepted drafts, α_1..α_K; a column per engine."""
    names = list(sides)
    rows = [("tau", [fmt(s.get("tau")) for s in sides.values()]),
            ("rounds", [str(s.get("num_drafts", "-")) for s in sides.values()]),
            # Identical accepted counts with different τ point at round counting, not the head.
            ("accepted", [str(s.get("counters", {}).get("num_accepted_tokens", "-"))
                          for s in sides.values()])]
    rows += [(f"alpha_{j + 1}", [fmt((s.get("alpha") or [None] * k)[j]) for s in sides.values()])
             for j in range(k)]
    width = max(10, *(len(n) for n in names))
    lines = [f"{'':10}" + "".join(f"{n:>{width + 2}}" for n in names)]
    lines += [f"{r:10}" + "".join(f"{v:>{width + 2}}" for v in vals) for r, vals in rows]
    return "\n".join(lines)


# ----- ours: runs in the project venv ---------------------------------------------------------

def run_ours(a: argparse.Namespace) -> int:
    from inference_eval.engine.config import EngineConfig
    from inference_eval.engine.prompt_encoding import encode_prompt
    from inference_eval.engine.sampling import SamplingParams
    from inference_eval.engine.target import TargetConfig, load_target
    from inference_eval.evaluation.config import DraftConfig
    from inference_eval.evaluation.engines import build_engine
    from inference_eval.evaluation.metrics import TurnOutput, mean_accept_len
    from inference_eval.evaluation.prompts import PromptsConfig, load_prompts

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    head_dir = out / "head_eagle3"
    subprocess.run([sys.executable, "-m", "train.export", "--checkpoint", a.head, "--format",
                    "eagle3", "--output", str(head_dir)], check=True)
    loaded = load_target(TargetConfig())
    pcfg = (PromptsConfig(name="jsonl", path=a.prompts, limit=a.n, max_turns=1)
            if a.prompts.endswith(".jsonl") else
            PromptsConfig(name=a.prompts, limit=a.n, max_turns=1, per_category=1))
    items = load_prompts(pcfg)
    ids = [encode_prompt(loaded.tokenizer, it.turns[0], chat=True) for it in items]
    params = SamplingParams(temperature=0.0, max_new_tokens=a.max_new)
    # head_code=none: vLLM serves the exported fp32 head, so ours drafts from the same floats.
    cfg = EngineConfig(max_batch_size=a.batch, head_code="none")
    runs = {}
    for label, draft in (("ar", DraftConfig(kind="none")),
                         ("spec", DraftConfig(kind="head", checkpoint=str(head_dir),
                                              num_draft=a.k))):
        engine = build_engine(loaded, cfg, draft)
        runs[label] = engine.generate(ids, params, progress=False)
    outs = [TurnOutput.from_result(it.id, it.category, 0, r) for it, r in zip(items, runs["spec"])]
    errors = [o.error for o in outs if not o.ok]
    if errors:
        raise SystemExit(f"our engine failed on {len(errors)} prompts: {errors[:3]}")
    counters = counters_from_steps([p for o in outs for p in o.proposed],
                                   [x for o in outs for x in o.accepted], a.k)
    record = {"hf_dir": str(loaded.hf_dir), "head_dir": str(head_dir.resolve()), "k": a.k,
              "max_new_tokens": a.max_new, "prompts": [
                  {"id": it.id, "category": it.category, "prompt_ids": p,
                   "token_ids": list(r.token_ids), "ar_token_ids": list(ar.token_ids)}
                  for it, p, r, ar in zip(items, ids, runs["spec"], runs["ar"])],
              "counters": counters, "engine_tau": mean_accept_len(outs),
              **rates_from_counters(counters, a.k)}
    (out / "ours.json").write_text(json.dumps(record))
    print(f"ours: {len(items)} prompts, tau={fmt(record['tau'])} "
          f"alpha={[fmt(x) for x in record['alpha']]} -> {out / 'ours.json'}")
    return 0


# ----- vllm: runs in vLLM's own venv; imports nothing from this repository --------------------

def read_spec_metrics(metrics: Sequence[Any]) -> dict[str, Any]:
    """vLLM V1 `LLM.get_metrics()` -> our counter names (summed over label sets)."""
    names = {"vllm:spec_decode_num_drafts": "num_drafts",
             "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
    c: dict[str, Any] = {v: 0 for v in names.values()}
    c["accepted_per_pos"] = []
    for m in metrics:
        if m.name in names:
            c[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            old = c["accepted_per_pos"] + [0] * (len(vals) - len(c["accepted_per_pos"]))
            c["accepted_per_pos"] = [x + y for x, y in zip(old, vals + [0] * len(old))]
    return c


def run_vllm(a: argparse.Namespace) -> int:
    out = Path(a.out)
    ours = json.loads((out / "ours.json").read_text())
    k, dest = ours["k"], out / "vllm.json"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; the CPU default is 4
    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams
    except Exception as exc:  # noqa: BLE001 - reported, the check cannot run without vLLM
        dest.write_text(json.dumps({"error": f"vllm import failed: {exc!r}"}))
        print(f"vllm side: cannot import vllm ({exc!r})", file=sys.stderr)
        return 2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Room for the longest prompt, its answer and a round of drafts past the end.
    max_len = a.max_model_len or (max(len(p["prompt_ids"]) for p in ours["prompts"])
                                  + ours["max_new_tokens"] + 2 * k + 16)
    spec = {"method": "eagle3", "model": ours["head_dir"], "num_speculative_tokens": k}
    try:
        # fp32 like our engine, so greedy ties and near-ties break the same way.
        llm = LLM(model=ours["hf_dir"], speculative_config=spec, dtype=a.dtype,
                  max_model_len=max_len, enforce_eager=True, disable_log_stats=False,
                  seed=0, **({"gpu_memory_utilization": 0.5} if device == "cuda" else {}))
    except Exception as exc:  # noqa: BLE001 - the message names the limitation
        msg = (f"vLLM {vllm.__version__} on {device} cannot serve an EAGLE-3 head: "
               f"{type(exc).__name__}: {exc}")
        if device == "cpu":
            msg += ("\nvLLM's CPU backend may not support EAGLE-3 speculative decoding in this "
                    "version; run this check on a GPU machine: pip install vllm, then "
                    "VLLM_PYTHON=<that venv>/bin/python bash scripts/check_vllm.sh")
        dest.write_text(json.dumps({"error": msg, "vllm": vllm.__version__, "device": device}))
        print(msg, file=sys.stderr)
        return UNSUPPORTED
    params = SamplingParams(temperature=0.0, max_tokens=ours["max_new_tokens"])
    prompts = [{"prompt_token_ids": p["prompt_ids"]} for p in ours["prompts"]]
    results = llm.generate(prompts, params, use_tqdm=False)
    counters = read_spec_metrics(llm.get_metrics())
    record = {"vllm": vllm.__version__, "device": device, "dtype": a.dtype, "k": k,
              "token_ids": [list(r.outputs[0].token_ids) for r in results],
              "counters": counters, **rates_from_counters(counters, k)}
    dest.write_text(json.dumps(record))
    print(f"vllm: tau={fmt(record['tau'])} alpha={[fmt(x) for x in record['alpha']]} -> {dest}")
    return 0


# ----- compare: either venv ------------------------------------------------------------------

def run_compare(a: argparse.Namespace) -> int:
    out = Path(a.out)
    ours = json.loads((out / "ours.json").read_text())
    path = out / "vllm.json"
    theirs = json.loads(path.read_text()) if path.exists() else {"error": "vllm side not run"}
    k, prompts = ours["k"], ours["prompts"]
    ours_ids = [p["token_ids"] for p in prompts]
    lossless = compare_outputs(ours_ids, [p["ar_token_ids"] for p in prompts])
    summary = {"k": k, "num_prompts": len(prompts), "ours_tau": ours["tau"],
               "ours_engine_tau": ours["engine_tau"], "ours_alpha": ours["alpha"],
               "ours_spec_vs_ar_mismatched": len(lossless)}
    if "error" in theirs:
        print(f"vLLM side did not run: {theirs['error']}")
        print(json.dumps({**summary, "vllm_error": theirs["error"]}))
        return UNSUPPORTED
    diff = compare_outputs(ours_ids, theirs["token_ids"])
    print(table(k, {"specheads": ours, f"vllm {theirs['vllm']}": theirs}))
    print(f"our engine's own tau (prefills out, every round): {fmt(ours['engine_tau'])}; "
          f"vLLM alpha exact: {theirs['exact']}")
    print(f"greedy outputs differing: {len(diff)}/{len(prompts)} "
          f"(first differing token: {[d['at'] for d in diff][:10]}); "
          f"ours spec vs ours AR: {len(lossless)}/{len(prompts)}")
    print(json.dumps({**summary, "vllm": theirs["vllm"], "vllm_device": theirs["device"],
                      "vllm_tau": theirs["tau"], "vllm_alpha": theirs["alpha"],
                      "outputs_mismatched": len(diff), "mismatches": diff[:20]}))
    return 0 if not diff else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="side", required=True)
    for name in ("ours", "vllm", "compare"):
        s = sub.add_parser(name)
        s.add_argument("--out", default="runs/vllm_check/cmp")
    o = sub.choices["ours"]
    o.add_argument("--head", required=True, help="head checkpoint (ours or any format)")
    o.add_argument("--k", type=int, default=3, help="drafts per round (chain)")
    o.add_argument("--n", type=int, default=12, help="prompts")
    o.add_argument("--prompts", default="heldout_mix", help="a prompt set name or a .jsonl")
    o.add_argument("--max-new", type=int, default=64)
    o.add_argument("--batch", type=int, default=4)
    v = sub.choices["vllm"]
    v.add_argument("--dtype", default="float32")
    v.add_argument("--max-model-len", type=int, default=None, help="default: what the prompts need")
    a = p.parse_args(argv)
    return {"ours": run_ours, "vllm": run_vllm, "compare": run_compare}[a.side](a)


if __name__ == "__main__":
    sys.exit(main())
