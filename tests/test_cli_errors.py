"""Every CLI reports the user's error as one line naming it and the fix, exit code 2, with no
traceback and no Hydra footer; a bug keeps its traceback (inference_eval/hydra_app.py: the rule).

Each CLI runs as a subprocess on the tiny random target and fails in seconds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inference_eval.hydra_app import exit_user_error, one_line, user_errors

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
ENV.pop("HYDRA_FULL_ERROR", None)
EVAL = ["target=tiny", "engine.attention=torch", "engine.num_pages=64", "eval.progress=false",
        "eval.warmup=false", "eval.batch_size=1", "sampling.max_new_tokens=2"]
# conf/target/tiny.yaml with another vocabulary: a target whose heads do not fit `tiny`.
OTHER_TARGET = ["target=tiny", "target.name=tiny-v300", "target.tokenizer=null",
                "target.arch.vocab_size=300"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m <args>` from the repo root."""
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def assert_user_error(proc: subprocess.CompletedProcess, *names: str,
                      label: str = "error") -> str:
    """rc 2 and a last stderr line `label: ...` holding every one of `names`; no traceback."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"{label}: "), proc.stderr
    for name in names:
        assert name in line, (name, line)
    return line


@pytest.fixture
def bad_jsonl(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2+2?"}) + "\n{\"prompt\": \"unterminated\n")
    return path


# ---- bad input lines ------------------------------------------------------------------------
def test_eval_malformed_prompt_line(bad_jsonl, tmp_path):
    proc = cli("inference_eval", *EVAL, "prompts=jsonl", f"prompts.path={bad_jsonl}",
               f"output_dir={tmp_path / 'o'}")
    assert_user_error(proc, f"{bad_jsonl}:2:", "not valid JSON")


def test_generate_malformed_prompt_line(bad_jsonl):
    proc = cli("inference_eval.generate", "target=tiny", f"prompts_file={bad_jsonl}")
    assert_user_error(proc, f"{bad_jsonl}:2:", "not valid JSON")


# ---- missing files --------------------------------------------------------------------------
@pytest.mark.parametrize("argv, fix", [
    (["inference_eval", *EVAL, "prompts=jsonl", "prompts.path={missing}"], "prompts.path"),
    (["inference_eval.generate", "target=tiny", "prompts_file={missing}"], "prompts_file"),
    (["precompute", "target=tiny", "data=jsonl", "data.path={missing}", "output_dir={out}"],
     "data.path"),
    (["train", *OTHER_TARGET, "data.shards={missing}", "output_dir={out}"], "precompute"),
])
def test_missing_input_file(argv, fix, tmp_path):
    missing, out = tmp_path / "no_such_file.jsonl", tmp_path / "out"
    proc = cli(*(a.format(missing=missing, out=out) for a in argv))
    assert_user_error(proc, str(missing), fix)
    assert not out.exists()


def test_corrupt_shard_stops_train(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"question {i}"},
        {"from": "gpt", "value": "the draft head reads hidden states " * 4}]}) + "\n"
        for i in range(3)))
    shards = tmp_path / "shards"
    proc = cli("precompute", "target=tiny", "data=jsonl", f"data.path={chats}",
               f"output_dir={shards}", "shard_tokens=128", "batch_tokens=256", "progress=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    shard = shards / "shard_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-40] ^= 0xFF  # one flipped byte inside the hidden states
    shard.write_bytes(bytes(data))
    out = tmp_path / "head"
    proc = cli("train", "target=tiny", f"data.shards={shards}", f"output_dir={out}",
               "trainer.wandb=disabled", "validation.enabled=false", "trainer.device=cpu",
               "trainer.max_steps=1")
    assert_user_error(proc, str(shard), "is corrupt", "rerun precompute")
    assert not (out / "metrics.jsonl").exists()


# ---- head checkpoints -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def other_target_head(tmp_path_factory) -> Path:
    """A random MTP head saved for OTHER_TARGET (vocab 300), not for `tiny`."""
    from heads.checkpoint import save_head
    from heads.config import HeadConfig
    from heads.frozen import load_frozen
    from heads.registry import build_head
    from inference_eval.evaluation.config import EvalConfig
    from inference_eval.hydra_app import compose

    target = compose("eval", EvalConfig, OTHER_TARGET).target
    path = tmp_path_factory.mktemp("heads") / "mtp_v300"
    return save_head(build_head(HeadConfig(type="mtp"), load_frozen(target), seed=0), path)


def test_eval_head_of_another_target(other_target_head, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hi."}) + "\n")
    proc = cli("inference_eval", *EVAL, "prompts=jsonl", f"prompts.path={prompts}",
               "draft=head", f"draft.checkpoint={other_target_head}",
               f"output_dir={tmp_path / 'o'}")
    assert_user_error(proc, str(other_target_head), "'tiny-v300'", "train a head for this target")


def test_eval_missing_head_checkpoint(bad_jsonl, tmp_path):
    missing = tmp_path / "no_such_head"
    bad_jsonl.write_text(json.dumps({"prompt": "Say hi."}) + "\n")
    proc = cli("inference_eval", *EVAL, "prompts=jsonl", f"prompts.path={bad_jsonl}",
               "draft=head", f"draft.checkpoint={missing}", f"output_dir={tmp_path / 'o'}")
    assert_user_error(proc, str(missing), "config.json")


@pytest.mark.parametrize("config, match", [
    (None, "config.json"),  # no checkpoint at all
    ({"architectures": ["LlamaForCausalLM"]}, "matches none of the formats"),
])
def test_export_missing_or_foreign_checkpoint(config, match, tmp_path):
    ck = tmp_path / "ck"
    if config is not None:
        ck.mkdir()
        (ck / "config.json").write_text(json.dumps(config))
    proc = cli("train.export", "--checkpoint", str(ck), "--format", "speculators",
               "--output", str(tmp_path / "out"))
    assert_user_error(proc, str(ck), match)
    assert not (tmp_path / "out").exists()


# ---- config errors and bugs -----------------------------------------------------------------
def test_unknown_preset_is_a_config_error():
    proc = cli("inference_eval.generate", "target=bogus", "prompts_file=p.txt")
    line = assert_user_error(proc, "target/bogus", "tiny", label="config error")
    assert "Config search path" not in line


def test_a_bug_keeps_its_traceback():
    script = "\n".join([
        "import sys",
        "sys.argv = ['generate', 'target=tiny', 'prompts_file=never_read.txt']",
        "from inference_eval.generate import GenerateConfig",
        "from inference_eval.hydra_app import run_cli",
        "def buggy(cfg):",
        "    raise RuntimeError('a bug, not bad input')",
        "run_cli('generate', GenerateConfig, buggy)",
    ])
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" in proc.stderr and "in buggy" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "RuntimeError: a bug, not bad input"


# ---- the boundary in process ----------------------------------------------------------------
def test_user_error_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_, user_errors():
        raise ValueError("f.jsonl:3: bad line\n  expected an object;\n\tfix it")
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "error: f.jsonl:3: bad line expected an object; fix it\n"
    with pytest.raises(SystemExit), user_errors():
        raise FileNotFoundError(2, "No such file or directory", "x.bin")
    assert capsys.readouterr().err == "error: [Errno 2] No such file or directory: 'x.bin'\n"


@pytest.mark.parametrize("exc", [RuntimeError("bug"), KeyError("k"), TypeError("t"),
                                 AssertionError()])
def test_other_exceptions_pass_through(exc, capsys):
    with pytest.raises(type(exc)), user_errors():
        raise exc
    assert capsys.readouterr().err == ""


def test_hydra_full_error_keeps_the_traceback_of_a_user_error(monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ValueError, match="bad"), user_errors():
        raise ValueError("bad")


def test_one_line_of_an_empty_message():
    assert one_line(ValueError()) == "ValueError"
    with pytest.raises(SystemExit):
        exit_user_error("already one line")
