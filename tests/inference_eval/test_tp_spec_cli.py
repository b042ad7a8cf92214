"""`torchrun --nproc_per_node 2 -m inference_eval ... engine.tensor_parallel=2`: rank 0 writes
the acceptance report, and every run in it (an MTP head as a chain and as a tree, the target
as its own draft LLM, lookup) is lossless and accepts exactly what one process accepts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from heads.checkpoint import save_head
from heads.config import HeadConfig
from heads.registry import build_head
from inference_eval.engine.target import load_target
from inference_eval.evaluation import evaluate
from inference_eval.evaluation.config import EvalConfig
from inference_eval.evaluation.engines import frozen_parts_of
from inference_eval.hydra_app import compose
from tp_ranks import free_port

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
FAST = ["target=tiny", "engine.attention=torch", "engine.num_pages=64", "eval.progress=false",
        "eval.batch_size=2", "sampling.max_new_tokens=8", "eval.warmup=false", "prompts=jsonl"]


def _eval_one_and_torchrun(tmp_path, records: list[dict], drafts: str, extra: list[str],
                           nproc: int) -> tuple[dict, dict]:
    """The eval of `records` with `drafts` (an MTP head at tmp_path/mtp) in one process and
    under torchrun with nproc ranks at T=2: (one's report, torchrun's report.json)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    base = compose("eval", EvalConfig, ["target=tiny"])
    save_head(build_head(HeadConfig(type="mtp"), frozen_parts_of(load_target(base.target)), seed=1),
              tmp_path / "mtp")
    args = [*FAST, *extra, f"prompts.path={prompts}", f"drafts={drafts}"]
    one = evaluate.main(compose("eval", EvalConfig, [*args, f"output_dir={tmp_path / 'one'}"]))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
         "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "inference_eval",
         *args, f"output_dir={tmp_path / 'tr'}", "engine.tensor_parallel=2"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return one, json.loads((tmp_path / "tr" / "report.json").read_text())


def _same_acceptance(one: dict, two: dict) -> None:
    for a, b in zip(one["runs"], two["runs"]):
        for key in ("generated_tokens", "target_steps", "mean_accept_len", "accept_len_hist"):
            assert a[key] == b[key], (a["name"], key)
        if b["scheme"] != "ar":
            assert b["lossless_check"]["mismatched"] == 0, b["name"]


def test_eval_cli_at_tp2_equals_one_process(tmp_path):
    mtp = tmp_path / "mtp"
    one, two = _eval_one_and_torchrun(tmp_path, [
        {"id": "a", "category": "math", "prompt": "What is 2+2?"},
        {"id": "b", "category": "writing", "prompt": "Write a haiku about caches."}],
        f"[{{kind:head,checkpoint:{mtp},name:c2,num_draft:2}},"
        f"{{kind:head,checkpoint:{mtp},name:t,scheme:tree,depth:3,topk:2,total_tokens:6}},"
        "{kind:llm,llm:${target},name:self,num_draft:3},{kind:lookup,name:lk,num_draft:3}]",
        [], nproc=2)
    assert two["settings"]["engine"]["tensor_parallel"] == 2
    assert [r["name"] for r in two["runs"]] == ["ar", "c2", "t", "self", "lk"]
    _same_acceptance(one, two)
    assert two["runs"][3]["mean_accept_len"] > 1 and two["runs"][4]["mean_accept_len"] > 1


def test_eval_cli_at_tp2_x_dp2_merges_the_replicas(tmp_path):
    """4 ranks, 2 replicas of 2: each replica evaluates every other prompt; rank 0's report
    holds every prompt once, in order, with what one process generates and accepts."""
    one, four = _eval_one_and_torchrun(tmp_path, [
        {"id": "a", "category": "math", "prompt": "What is 2+2?"},
        {"id": "b", "category": "writing", "prompt": "Write a haiku about caches."},
        {"id": "c", "category": "code", "prompt": "def add(a, b):"}],
        f"[{{kind:head,checkpoint:{tmp_path / 'mtp'},name:c2,num_draft:2}},"
        "{kind:llm,llm:${target},name:self,num_draft:3}]", ["eval.batch_size=1"], nproc=4)
    assert [r["name"] for r in four["runs"]] == ["ar", "c2", "self"]
    _same_acceptance(one, four)
    assert four["runs"][2]["mean_accept_len"] > 1
    lines = [json.loads(x) for x in (tmp_path / "tr" / "outputs.jsonl").read_text().splitlines()]
    assert [x["id"] for x in lines if x["run"] == "ar"] == ["a", "b", "c"]
