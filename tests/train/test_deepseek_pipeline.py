"""All three stages on the tiny random DeepSeek target (conf/target/tiny_deepseek.yaml: MLA,
MoE layers 1-2), composed from the same Hydra configs as the CLIs: precompute (with
data.regenerate, so the shards hold the target's own greedy answers) dumps last-layer states,
train fits an mtp head whose layer is MLA with a dense MLP, and the eval runs it as a chain
and as a tree: greedy output equals autoregressive output and drafts are accepted far above
chance (1 / 49152)."""
from __future__ import annotations

import json
import random

import torch

from inference_eval.evaluation.config import EvalConfig
from inference_eval.evaluation.evaluate import main as evaluate
from inference_eval.hydra_app import compose
from precompute.config import PrecomputeConfig
from precompute.run import main as precompute
from train.config import TrainConfig
from train.loop import train

TARGET = ["target=tiny_deepseek"]
WORDS = "the draft head reads hidden states of the target model and proposes tokens".split()


def test_precompute_train_eval_on_a_deepseek_target(tmp_path):
    torch.set_num_threads(1)
    rng = random.Random(0)
    chats = tmp_path / "chats.jsonl"
    with open(chats, "w") as f:
        for _ in range(10):
            user = " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))
            f.write(json.dumps({"conversations": [{"from": "human", "value": user},
                                                  {"from": "gpt", "value": "ok"}]}) + "\n")
    shards, head, report_dir = tmp_path / "shards", tmp_path / "head", tmp_path / "eval"

    precompute(compose("precompute", PrecomputeConfig, [
        *TARGET, "data=jsonl", f"data.path={chats}", "data.regenerate=true",
        "data.regen_max_new_tokens=32", f"output_dir={shards}", "progress=false"]))
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["hidden_size"] == 64 and manifest["complete"]
    assert manifest["target"]["arch"]["kv_lora_rank"] == 32

    # A sharp distillation temperature: the random target's distributions are near-uniform.
    train(compose("train", TrainConfig, [
        *TARGET, "head=mtp", f"data.shards={shards}", f"output_dir={head}",
        "trainer.wandb=disabled", "validation.enabled=false", "trainer.progress=false",
        "trainer.device=cpu", "data.batch_tokens=1024", "optim.lr=1e-2", "optim.warmup_steps=2",
        "trainer.max_steps=25", "trainer.log_every=25", "head.distill_temperature=0.05"]))
    saved = json.loads((head / "config.json").read_text())
    assert saved["head"]["type"] == "mtp" and saved["arch"]["kv_lora_rank"] == 32

    report = evaluate(compose("eval", EvalConfig, [
        *TARGET, "prompts=jsonl", f"prompts.path={chats}", f"output_dir={report_dir}",
        f"drafts=[{{preset:head,checkpoint:'{head}',name:chain,num_draft:3}},"
        f"{{preset:head,checkpoint:'{head}',scheme:tree,name:tree,depth:3,topk:4,total_tokens:12}}]",
        "sampling.max_new_tokens=32", "sampling.ignore_eos=true", "eval.progress=false",
        "eval.warmup=false", "engine.attention=torch"]))
    runs = {r["name"]: r for r in report["runs"]}
    for name in ("chain", "tree"):
        r = runs[name]
        assert r["lossless_check"]["compared"] == 10 and r["lossless_check"]["mismatched"] == 0
        assert r["per_position_accept_rate"][0] > 0.2, r["per_position_accept_rate"]
        assert r["mean_accept_len"] > 1.2, r["mean_accept_len"]
