"""`python -m inference_eval`: the CLI end to end on the tiny target, every shipped draft and
prompts config composed, several drafts in one report, and bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from inference_eval.evaluation import engines, evaluate
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.speculative.spec_engine import SpecEngine
from inference_eval.evaluation.config import DraftConfig, EvalConfig
from inference_eval.hydra_app import CONF_DIR, compose
from inference_eval.evaluation.report import PLOTS
from inference_eval.engine.target import TargetConfig

REPO = Path(__file__).resolve().parents[2]
DRAFTS = sorted(p.stem for p in (CONF_DIR / "draft").glob("*.yaml"))
PROMPT_SETS = sorted(p.stem for p in (CONF_DIR / "prompts").glob("*.yaml"))
REQUIRED = ("scheme", "num_prompts", "generated_tokens", "target_steps", "mean_accept_len",
            "accept_len_hist", "per_position_accept_rate", "tokens_per_s", "ar_tokens_per_s",
            "speedup", "lossless_check", "by_category")
FAST = ["target=tiny", "engine.attention=torch", "engine.num_pages=64", "eval.progress=false",
        "eval.batch_size=2", "sampling.max_new_tokens=6"]


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"id": "a", "category": "math", "prompt": "What is 2+2?"},
        {"question_id": 7, "category": "writing", "turns": ["Write a haiku.", "Shorter."]},
        {"messages": [{"role": "user", "content": "Say hi."}]},
    ]) + "\n")
    return path


def test_cli_draft_none_end_to_end(tmp_path, prompt_file):
    out = tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, "-m", "inference_eval", *FAST, "draft=none", "prompts=jsonl",
         f"prompts.path={prompt_file}", f"output_dir={out}"],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[ar] τ=1.000" in proc.stdout and f"report: {out / 'report.json'}" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert all(k in report for k in REQUIRED)
    assert report["num_prompts"] == 3 and report["runs"][0]["num_outputs"] == 4
    assert report["mean_accept_len"] == 1.0 == report["speedup"]
    assert report["generated_tokens"] == report["target_steps"] == sum(report["accept_len_hist"])
    assert sorted(report["by_category"]) == ["general", "math", "writing"]
    st = report["settings"]
    assert st["batch_size"] == 2 == st["engine"]["max_batch_size"] and st["max_new_tokens"] == 6
    assert st["target"]["name"] == "tiny" and st["prompts"]["num_turns"] == 4
    assert all((out / p).is_file() for p in PLOTS) and (out / "report.md").is_file()


@pytest.mark.parametrize("draft", DRAFTS)
def test_every_draft_config_composes(draft):
    extra = ["draft.checkpoint=runs/head"] if draft == "head" else []
    cfg = compose("eval", EvalConfig, ["target=tiny", f"draft={draft}", *extra])
    assert isinstance(cfg, EvalConfig) and isinstance(cfg.draft, DraftConfig)
    for key, value in yaml.safe_load((CONF_DIR / "draft" / f"{draft}.yaml").read_text()).items():
        got = getattr(cfg.draft, key)
        if key == "llm":
            assert isinstance(got, TargetConfig) and asdict(got).items() >= value.items()
        elif value != "???":
            assert got == value, key
    assert [d.kind for d in cfg.draft_runs()] == ([] if draft == "none" else [draft])


@pytest.mark.parametrize("prompts", PROMPT_SETS)
def test_every_prompts_config_composes(prompts):
    extra = ["prompts.path=p.jsonl"] if prompts == "jsonl" else []
    cfg = compose("eval", EvalConfig, [f"prompts={prompts}", *extra])
    preset = yaml.safe_load((CONF_DIR / "prompts" / f"{prompts}.yaml").read_text())
    for key, value in preset.items():
        if value != "???":
            assert getattr(cfg.prompts, key) == value, key


def test_drafts_list_resolves_presets():
    cfg = compose("eval", EvalConfig, [
        "target=tiny", "drafts=[{kind:head,checkpoint:runs/mtp,name:mtp},"
        "{kind:head,checkpoint:runs/e3,scheme:tree,depth:3},llm]"])
    assert [d.label for d in cfg.draft_runs()] == ["mtp", "e3-tree", "smollm2-135m-chain"]
    assert cfg.drafts[1].depth == 3 and cfg.drafts[1].topk == 10 and cfg.drafts[2].llm is not None


def test_autoregressive_control_in_drafts(tmp_path, prompt_file):
    """A `kind: none` entry of `drafts` runs the autoregressive engine again after the others
    (a drift control); unnamed, its label would be the baseline's, which is refused."""
    cfg = compose("eval", EvalConfig, [
        *FAST, "prompts=jsonl", f"prompts.path={prompt_file}", f"output_dir={tmp_path}",
        "eval.warmup=false", "drafts=[lookup,{kind:none,name:ar2}]"])
    assert [(d.kind, d.label) for d in cfg.draft_runs()] == [("lookup", "lookup-chain"), ("none", "ar2")]
    report = evaluate.main(cfg)
    assert [r["name"] for r in report["runs"]] == ["ar", "lookup-chain", "ar2"]
    ar, ar2 = report["runs"][0], report["runs"][2]
    assert ar2["lossless_check"]["compared"] == 4 and ar2["lossless_check"]["mismatched"] == 0
    assert ar2["mean_accept_len"] == 1.0 and ar2["target_steps"] == ar["target_steps"]
    assert set(ar2["time_split_s"]) == {"prefill", "decode"} and ar2["speedup"] > 0
    with pytest.raises(ValueError, match="clash with the baseline"):
        compose("eval", EvalConfig, ["target=tiny", "drafts=[lookup,{kind:none}]"])


@pytest.mark.parametrize("overrides, match", [
    (["draft=head"], "checkpoint"),
    (["prompts=jsonl"], "path"),
    (["eval.batch_size=0"], "eval.batch_size"),
    (["draft.scheme=star"], "draft.scheme"),
    (["drafts=[nope]"], "draft preset 'nope' does not exist"),
    (["drafts=[{kind:head,checkpoint:a},{kind:head,checkpoint:b/a}]"], "repeat"),
    (["drafts=[{kind:head}]"], "checkpoint"),
    (["drafts=[{kind:head,checkpoint:a,num_draft:0}]"], "num_draft"),
])
def test_bad_config_names_the_key(overrides, match):
    with pytest.raises(Exception, match=match):
        compose("eval", EvalConfig, overrides)


def test_empty_prompt_file_fails_before_loading_target(tmp_path, monkeypatch):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    monkeypatch.setattr(evaluate, "load_target", lambda *a, **k: pytest.fail("target loaded"))
    cfg = compose("eval", EvalConfig, [*FAST, "prompts=jsonl", f"prompts.path={empty}"])
    with pytest.raises(ValueError, match=f"{empty}: the prompt file is empty"):
        evaluate.main(cfg)


def test_missing_head_checkpoint_is_a_clear_error_before_the_baseline(monkeypatch, prompt_file,
                                                                      tmp_path):
    """A draft that cannot load fails before the target loads and the baseline runs (which
    can take an hour), naming the checkpoint."""
    monkeypatch.setattr(evaluate, "load_target", lambda *a, **k: pytest.fail("target loaded"))
    missing = tmp_path / "no_such_head"
    cfg = compose("eval", EvalConfig, [*FAST, "draft=head", f"draft.checkpoint={missing}",
                                       "prompts=jsonl", f"prompts.path={prompt_file}"])
    with pytest.raises(FileNotFoundError, match="no_such_head"):
        evaluate.main(cfg)


class FakeSpecEngine:
    """LLMEngine's tokens, regrouped into steps of up to K+1 as a chain drafter would emit
    them, with a marked text (so a replayed history is told from its own); a prompt
    containing EXPLODE makes the whole batch raise."""

    seen: list = []

    def __init__(self, loaded, engine_cfg, draft):
        assert isinstance(draft, DraftConfig) and engine_cfg.max_batch_size == 2
        self.inner, self.k = LLMEngine(loaded.model, loaded.tokenizer, engine_cfg), draft.num_draft

    def warm(self, batch_size=1):
        self.inner.warm(batch_size)

    def generate(self, prompts, params, chat=True, progress=True):
        FakeSpecEngine.seen.append(list(prompts))
        if "EXPLODE" in json.dumps(prompts):
            raise RuntimeError("kaboom")
        results = self.inner.generate(prompts, params, chat=chat, progress=progress)
        for r in results:
            p, a, left = [0], [0], len(r.token_ids) - 1
            while left > 0:
                take = min(left, self.k + 1)
                p, a, left = p + [self.k], a + [take - 1], left - take
            r.meta = {"target_steps": len(p), "proposed": p, "accepted": a, "prefill_steps": 1}
            r.text = f"{r.text} [k={self.k}]"
        return results


def test_several_drafts_one_report_and_a_failing_prompt(tmp_path, prompt_file, monkeypatch):
    with open(prompt_file, "a") as f:
        f.write(json.dumps({"id": "boom", "prompt": "EXPLODE please"}) + "\n")
    monkeypatch.setattr(engines, "build_spec_engine", FakeSpecEngine)
    monkeypatch.setattr(evaluate, "read_head_config", lambda path: {})  # no checkpoint is read
    FakeSpecEngine.seen = []
    cfg = compose("eval", EvalConfig, [
        *FAST, "prompts=jsonl", f"prompts.path={prompt_file}", f"output_dir={tmp_path / 'o'}",
        "drafts=[{kind:head,checkpoint:ck,name:k2,num_draft:2},{kind:head,checkpoint:ck,name:k3,"
        "num_draft:3}]", "eval.repeats=2"])
    report = evaluate.main(cfg)
    assert [r["name"] for r in report["runs"]] == ["ar", "k2", "k3"] and report["primary"] == "k2"
    ar, k2, k3 = report["runs"]
    outputs = [json.loads(x) for x in (tmp_path / "o" / "outputs.jsonl").read_text().splitlines()]
    boom_tokens = next(o["num_tokens"] for o in outputs if o["run"] == "ar" and o["id"] == "boom")
    assert ar["num_errors"] == 0 and ar["num_outputs"] == 5
    for run, k in ((k2, 2), (k3, 3)):
        assert run["errors"] == [{"id": "boom", "turn": 0, "error": "RuntimeError: kaboom"}]
        assert run["num_outputs"] == 5
        assert run["generated_tokens"] == ar["generated_tokens"] - boom_tokens
        assert run["lossless_check"]["compared"] == 4 and run["lossless_check"]["mismatched"] == 0
        assert len(run["accept_len_hist"]) == k + 1 and run["mean_accept_len"] > 1
    # Two interleaved timed passes per run; acceptance from the first.
    assert all(len(r["wall_s_passes"]) == 2 and r["best_speedup"] > 0 for r in (ar, k2, k3))
    assert all(r["wall_s"] == min(r["wall_s_passes"]) for r in (ar, k2, k3))  # lower median
    # Turn 2 of the MT-bench item replays the baseline's answer to turn 1, not the run's own.
    answer = next(o["text"] for o in outputs
                  if o["run"] == "ar" and o["id"] == "7" and o["turn"] == 0)
    own = next(o["text"] for o in outputs if o["run"] == "k3" and o["id"] == "7" and o["turn"] == 0)
    assert own != answer and own.endswith("[k=3]")
    second = [p for batch in FakeSpecEngine.seen for p in batch if len(p) == 3][-1]
    assert second == [{"role": "user", "content": "Write a haiku."},
                      {"role": "assistant", "content": answer},
                      {"role": "user", "content": "Shorter."}]
    assert json.loads((tmp_path / "o" / "report.json").read_text())["primary"] == "k2"


def test_real_spec_engine_self_draft_is_lossless(tmp_path, prompt_file, monkeypatch):
    """draft=llm with the target itself as the draft, through engines.build_engine and the real
    SpecEngine: every draft is accepted and greedy output equals the baseline's."""
    calls = []
    real = SpecEngine.generate

    def generate(self, *args, **kwargs):
        calls.append(type(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(SpecEngine, "generate", generate)
    cfg = compose("eval", EvalConfig, [
        *FAST, "draft=llm", "draft.llm=${target}", "draft.name=self", "draft.num_draft=3",
        "prompts=jsonl", f"prompts.path={prompt_file}", f"output_dir={tmp_path}",
        "eval.warmup=false"])
    report = evaluate.main(cfg)
    assert calls and set(calls) == {SpecEngine}
    assert report["primary"] == "self" and report["num_errors"] == 0
    assert report["lossless_check"]["compared"] == 4 and report["lossless_check"]["mismatched"] == 0
    assert report["per_position_accept_rate"] == [1.0, 1.0, 1.0]
    pre = report["prefill_steps"]
    assert pre == 4  # one per prompt: nothing was preempted
    assert report["mean_accept_len"] > 1
    assert report["mean_accept_len"] == pytest.approx(
        (report["generated_tokens"] - pre) / (report["target_steps"] - pre))
    assert report["tokens_per_target_pass"] == report["generated_tokens"] / report["target_steps"]


def test_head_chain_and_tree_side_by_side(tmp_path, prompt_file):
    """A (random) head drafting as a chain and as an EAGLE-2 tree in one report: lossless,
    τ = tokens / target steps, and the time split covers every speculative phase."""
    from heads.checkpoint import save_head
    from heads.config import HeadConfig
    from heads.registry import build_head
    from inference_eval.evaluation.engines import frozen_parts_of
    from inference_eval.engine.target import load_target

    base = compose("eval", EvalConfig, [*FAST, "prompts=jsonl", f"prompts.path={prompt_file}"])
    save_head(build_head(HeadConfig(type="mtp"), frozen_parts_of(load_target(base.target)), seed=1),
              tmp_path / "mtp")
    cfg = compose("eval", EvalConfig, [
        *FAST, "prompts=jsonl", f"prompts.path={prompt_file}", f"output_dir={tmp_path / 'o'}",
        "eval.warmup=false", f"drafts=[{{kind:head,checkpoint:{tmp_path / 'mtp'},name:c2,num_draft:2}},"
        f"{{kind:head,checkpoint:{tmp_path / 'mtp'},name:t,scheme:tree,depth:3,topk:3,total_tokens:6}}]"])
    report = evaluate.main(cfg)
    ar, c2, tree = report["runs"]
    assert (c2["scheme"], tree["scheme"]) == ("chain", "tree")
    for run, k in ((c2, 2), (tree, 3)):
        assert run["lossless_check"] == {"compared": 4, "mismatched": 0, "mismatches": []}
        pre = run["prefill_steps"]
        assert run["mean_accept_len"] == pytest.approx(
            (run["generated_tokens"] - pre) / (run["target_steps"] - pre))
        assert sum(run["accept_len_hist"]) == run["target_steps"] and len(run["accept_len_hist"]) <= k + 1
        split = run["time_split_s"]
        assert set(split) == {"prefill", "draft", "verify", "catch_up"}
        assert all(v > 0 for v in split.values()) and sum(split.values()) <= run["wall_s"]
    assert set(ar["time_split_s"]) == {"prefill", "decode"}  # the baseline is split too
    assert sum(ar["time_split_s"].values()) <= ar["wall_s"]
    for run in (c2, tree):
        assert run["decode_speedup"] > 0 and run["decode_tokens_per_s"] > 0
    assert c2["host_syncs_per_round"] == 1.0  # drafts stay on the device until verification
    assert "Where the time goes" in (tmp_path / "o" / "report.md").read_text()
