"""Exporters and importers (train/export): round trips per format with identical logits on a
tiny HF target, what each format's files hold, the CLI, and bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from heads.batch import PackedBatch
from heads.checkpoint import load_head, read_head_config, save_head
from heads.config import HeadConfig
from heads.frozen import load_frozen
from heads.registry import build_head
from heads.rollout import rollout
from inference_eval.engine.target import TargetConfig
from tiny_hf_models import make_tiny_hf
from heads.formats import detect_format, export_head, import_head

REPO = Path(__file__).resolve().parents[2]
H, V, L = 96, 320, 3  # the tiny HF family's hidden size, vocabulary and depth


@pytest.fixture(scope="module")
def target(tiny_hf):
    """(HF dir, FrozenParts) of the tiny llama3 family (rope scaling, untied lm_head)."""
    d, _ = tiny_hf("llama3")
    return d, load_frozen(TargetConfig(name="tiny-llama3", source="hf", path=str(d)))


def make_head(kind: str, parts, reduced: bool = False, steps: int = 3, seed: int = 5,
              layers: int = 1):
    """A head whose every trainable tensor is random (norms too), so a swapped or dropped
    tensor changes the logits."""
    vocab = torch.arange(3, V, 4) if reduced else None
    cfg = HeadConfig(type=kind, num_steps=steps, aux_layers=[0, 1, 2] if kind == "eagle3" else [],
                     draft_vocab_size=None if vocab is None else vocab.numel(), num_layers=layers)
    head = build_head(cfg, parts, draft_vocab=vocab, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.requires_grad:
                base = 1.0 if name.endswith("norm.weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
    return head


def batch(seed: int = 0) -> PackedBatch:
    """Two packed sequences (9 and 6 tokens) with hidden [15, H] and aux [15, 3, H]."""
    g = torch.Generator().manual_seed(seed)
    n = 15
    return PackedBatch(torch.randint(0, V, (n,), generator=g), torch.randn(n, H, generator=g),
                       torch.ones(n, dtype=torch.bool), [9, 6], torch.randn(n, 3, H, generator=g))


def step_logits(head) -> list[torch.Tensor]:
    with torch.no_grad():
        return [head.logits(o.features) for o in rollout(head.eval(), batch())]


def assert_same_logits(a, b) -> None:
    la, lb = step_logits(a), step_logits(b)
    assert len(la) == len(lb) == a.cfg.num_steps
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def tensor_names(path: Path) -> set[str]:
    names = set()
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as sf:
            names |= set(sf.keys())
    return names


CASES = [("eagle3", "speculators", False, 1), ("eagle3", "speculators", True, 1),
         ("eagle3", "speculators", True, 3),  # speculators' multi-layer EAGLE-3
         ("eagle3", "eagle3", False, 1), ("eagle3", "eagle3", True, 1),
         ("eagle1", "eagle1", False, 1), ("mtp", "deepseek_mtp", False, 1)]


@pytest.mark.parametrize("kind,fmt,reduced,layers", CASES)
def test_round_trip_gives_identical_logits(kind, fmt, reduced, layers, target, tmp_path):
    tdir, parts = target
    head = make_head(kind, parts, reduced, layers=layers)
    save_head(head, tmp_path / "ours")
    out = export_head(tmp_path / "ours", fmt, tmp_path / fmt, target_dir=tdir)
    assert detect_format(out) == fmt
    back = import_head(out, parts)
    assert back.cfg == head.cfg  # training settings survive (specheads_head)
    assert_same_logits(head, back)
    # The eval path: load_head and read_head_config accept the foreign directory too.
    assert_same_logits(head, load_head(out, parts))
    meta = read_head_config(out)
    assert meta["format"] == fmt and meta["head"]["type"] == kind
    assert meta["target"]["frozen_sha256"] == parts.identity["frozen_sha256"]
    with pytest.raises(ValueError, match="medusa"):
        load_head(out, parts, expect_type="medusa")


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_deepseek_mtp_round_trip_with_qkv_bias_and_qk_norm(family, tiny_hf, tmp_path):
    """The MTP layer is the target's own layer type: q/k/v biases and q/k norms travel too."""
    d, _ = tiny_hf(family)
    parts = load_frozen(TargetConfig(name=family, source="hf", path=str(d)))
    head = make_head("mtp", parts)
    save_head(head, tmp_path / "ours")
    out = export_head(tmp_path / "ours", "deepseek_mtp", tmp_path / "mtp", target_dir=d)
    extra = "self_attn.q_proj.bias" if family == "qwen2" else "self_attn.q_norm.weight"
    assert f"model.layers.{L}.{extra}" in tensor_names(out)
    assert_same_logits(head, import_head(out, parts))


def test_foreign_to_foreign_conversion_keeps_the_logits(target, tmp_path):
    """An SGLang EAGLE-3 directory converts to vLLM's speculators format without the target."""
    _, parts = target
    head = make_head("eagle3", parts, reduced=True)
    save_head(head, tmp_path / "ours")
    sglang = export_head(tmp_path / "ours", "eagle3", tmp_path / "sglang")
    vllm = export_head(sglang, "speculators", tmp_path / "vllm")
    assert detect_format(vllm) == "speculators"
    assert_same_logits(head, import_head(vllm, parts))


def test_eagle3_files_follow_engine_conventions(target, tmp_path):
    """Names, d2t offsets, t2d mask and aux ids as SGLang/vLLM read them."""
    tdir, parts = target
    for reduced in (False, True):
        head = make_head("eagle3", parts, reduced)
        save_head(head, tmp_path / f"ours{reduced}")
        out = export_head(tmp_path / f"ours{reduced}", "eagle3", tmp_path / f"e3{reduced}")
        t = load_file(str(out / "model.safetensors"))
        cfg = json.loads((out / "config.json").read_text())
        layer = {f"midlayer.{n}.weight" for n in (
            "input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.q_proj",
            "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")}
        vocab = {"lm_head.weight", "d2t", "t2d"} if reduced else set()
        assert set(t) == {"fc.weight", "norm.weight"} | layer | vocab  # nothing the format lacks
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # ours + 1
        assert cfg["norm_before_residual"] is False
        assert t["midlayer.self_attn.q_proj.weight"].shape == (6 * 16, 2 * H)  # [emb; hidden]
        if reduced:
            ids = head.d2t_ids
            assert cfg["draft_vocab_size"] == ids.numel()
            assert torch.equal(t["d2t"] + torch.arange(ids.numel()), ids)  # offsets
            assert t["t2d"].dtype == torch.bool and torch.equal(t["t2d"].nonzero().flatten(), ids)
        else:
            assert cfg["draft_vocab_size"] is None  # full vocabulary: lm_head from the target


def test_deepseek_mtp_stitches_into_a_loadable_target(target, tmp_path):
    from transformers import AutoModelForCausalLM

    tdir, parts = target
    save_head(make_head("mtp", parts), tmp_path / "ours")
    out = export_head(tmp_path / "ours", "deepseek_mtp", tmp_path / "mtp", target_dir=tdir)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    original = tensor_names(Path(tdir))
    mtp = {n for n, f in index.items() if f == "model-mtp.safetensors"}
    assert original <= set(index) and set(index) == original | mtp
    assert {f"model.layers.{L}.{n}.weight" for n in (
        "enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens",
        "input_layernorm", "self_attn.q_proj", "mlp.up_proj")} <= mtp
    assert all(n.startswith(f"model.layers.{L}.") for n in mtp)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["num_hidden_layers"] == L
    assert (out / "model.safetensors").is_symlink()  # the target's shard is not duplicated
    # The stitched directory still loads as the target, with the target's logits.
    ids = torch.randint(0, V, (1, 11), generator=torch.Generator().manual_seed(1))
    ref = AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(got(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_cli_exports_and_imports_back(target, tmp_path):
    tdir, parts = target
    head = make_head("eagle3", parts, reduced=True)
    save_head(head, tmp_path / "ours")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "train.export", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=300)

    r = run("--checkpoint", str(tmp_path / "ours"), "--format", "speculators",
            "--output", str(tmp_path / "vllm"))
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line["export"] == "speculators" and "model.safetensors" in line["files"]
    r = run("--checkpoint", str(tmp_path / "vllm"), "--format", "specheads",
            "--target-dir", str(tdir), "--output", str(tmp_path / "back"))
    assert r.returncode == 0, r.stderr
    assert read_head_config(tmp_path / "back")["imported_from"]["format"] == "speculators"
    assert_same_logits(head, load_head(tmp_path / "back", parts))
    r = run("--checkpoint", str(tmp_path / "ours"), "--format", "eagle1",
            "--output", str(tmp_path / "bad"))
    assert r.returncode == 2 and "cannot export a 'eagle3' head to format 'eagle1'" in r.stderr


# ---- bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize("kind,fmt,goes_to", [
    ("medusa", "eagle3", "no foreign format"), ("medusa", "speculators", "no foreign format"),
    ("eagle1", "eagle3", "['eagle1']"), ("mtp", "eagle1", "['deepseek_mtp']"),
    ("eagle3", "deepseek_mtp", "['speculators', 'eagle3']")])
def test_format_that_cannot_express_the_head_says_where_it_can_go(kind, fmt, goes_to, target,
                                                                   tmp_path):
    _, parts = target
    save_head(make_head(kind, parts), tmp_path / "ours")
    with pytest.raises(ValueError) as exc:
        export_head(tmp_path / "ours", fmt, tmp_path / "out")
    msg = str(exc.value)
    assert f"{kind!r} head" in msg and f"format {fmt!r}" in msg and goes_to in msg
    assert not (tmp_path / "out").exists()


def test_layers_the_engines_cannot_hold_are_refused(tiny_hf, target, tmp_path):
    d, _ = tiny_hf("qwen2")  # q/k/v bias: vLLM and SGLang EAGLE layers have none
    parts = load_frozen(TargetConfig(name="tiny-qwen2", source="hf", path=str(d)))
    save_head(make_head("eagle3", parts), tmp_path / "ours")
    for fmt in ("eagle3", "speculators"):
        with pytest.raises(ValueError, match="q/k/v bias"):
            export_head(tmp_path / "ours", fmt, tmp_path / fmt)
    save_head(make_head("eagle3", target[1], layers=2), tmp_path / "deep")
    with pytest.raises(ValueError, match="holds one draft layer.*'speculators'"):
        export_head(tmp_path / "deep", "eagle3", tmp_path / "deep_e3")
    two_aux = build_head(HeadConfig(type="eagle3", aux_layers=[0, 2]), target[1])
    save_head(two_aux, tmp_path / "two")
    with pytest.raises(ValueError, match="exactly 3 auxiliary layers"):
        export_head(tmp_path / "two", "eagle3", tmp_path / "e3")


def test_missing_files_and_tensors(target, tmp_path):
    tdir, parts = target
    with pytest.raises(FileNotFoundError, match="config.json"):
        export_head(tmp_path / "nothing", "eagle3", tmp_path / "o")
    save_head(make_head("eagle3", parts), tmp_path / "ours")
    (tmp_path / "ours" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        export_head(tmp_path / "ours", "eagle3", tmp_path / "o")
    save_head(make_head("eagle3", parts), tmp_path / "ours")
    out = export_head(tmp_path / "ours", "eagle3", tmp_path / "e3")
    t = load_file(str(out / "model.safetensors"))
    weights = out / "model.safetensors"
    save_file({k: v for k, v in t.items() if k != "midlayer.self_attn.k_proj.weight"}, str(weights))
    with pytest.raises(ValueError, match="split tensors"):
        import_head(out, parts)
    save_file({**t, "midlayer.extra_norm.weight": torch.ones(H)}, str(weights))
    with pytest.raises(ValueError, match="extra_norm"):
        import_head(out, parts)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        import_head(out, parts)
    # a speculators EAGLE-3 whose config declares more layers than its tensors hold
    save_head(make_head("eagle3", parts, layers=2), tmp_path / "deep")
    spec = export_head(tmp_path / "deep", "speculators", tmp_path / "deep_spec")
    t = load_file(str(spec / "model.safetensors"))
    save_file({k: v for k, v in t.items() if not k.startswith("layers.1.")},
              str(spec / "model.safetensors"))
    with pytest.raises(ValueError, match=r"declares 2 draft layers, but layers\.1\.\* is missing"):
        import_head(spec, parts)
    cfg = json.loads((spec / "config.json").read_text())
    cfg["transformer_layer_config"]["layer_types"] = ["sliding_attention", "full_attention"]
    (spec / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="sliding-window draft layers"):
        import_head(spec, parts)
    save_head(make_head("mtp", parts), tmp_path / "mtp")
    with pytest.raises(ValueError, match="target_dir"):
        export_head(tmp_path / "mtp", "deepseek_mtp", tmp_path / "m")  # mtp needs the target
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="matches none of the formats"):
        import_head(tmp_path / "junk", parts)


def test_import_onto_the_wrong_target_is_refused(target, tmp_path):
    tdir, parts = target
    save_head(make_head("eagle3", parts, reduced=True), tmp_path / "ours")
    out = export_head(tmp_path / "ours", "speculators", tmp_path / "spec")
    narrow = load_frozen(TargetConfig(name="narrow", source="random", path=None, arch=dict(
        vocab_size=V, hidden_size=64, intermediate_size=192, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=16)))
    with pytest.raises(ValueError, match="hidden_size=96.*hidden_size=64"):
        import_head(out, narrow)
    # deepseek_mtp checks the target directory is the one the head was trained for.
    save_head(make_head("mtp", parts), tmp_path / "mtp_ours")
    other = tmp_path / "other_target"
    make_tiny_hf("llama3", other, seed=1)
    with pytest.raises(ValueError, match="embedding/norm/lm_head differ"):
        export_head(tmp_path / "mtp_ours", "deepseek_mtp", tmp_path / "m", target_dir=other)


def test_eval_engine_drafts_with_a_foreign_directory(tiny_hf, tmp_path, monkeypatch):
    """The eval path (read_head_config + load_head in build_engine) takes the exported directory
    and drafts exactly what our own checkpoint drafts: every draft logit row is equal."""
    from types import SimpleNamespace

    from inference_eval.engine.config import EngineConfig
    from inference_eval.engine.sampling import SamplingParams
    from inference_eval.engine.speculative.drafters import HeadDrafter
    from inference_eval.evaluation.engines import build_engine, frozen_parts_of
    from inference_eval.engine.target import load_target

    drafted: list[torch.Tensor] = []
    run = HeadDrafter.run

    def recording_run(self, *args, **kwargs):
        nxt, logits = run(self, *args, **kwargs)
        drafted.append(logits.clone())
        return nxt, logits

    monkeypatch.setattr(HeadDrafter, "run", recording_run)

    d, _ = tiny_hf("llama3")
    loaded = load_target(TargetConfig(name="tiny-llama3", source="hf", path=str(d)),
                         with_tokenizer=False)
    save_head(make_head("eagle3", frozen_parts_of(loaded), reduced=True), tmp_path / "ours")
    export_head(tmp_path / "ours", "speculators", tmp_path / "vllm")
    prompts = [list(range(5, 17)), list(range(40, 47))]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    runs, logits = [], []
    for ckpt in ("ours", "vllm"):
        eng = build_engine(loaded, EngineConfig(attention="torch", page_size=4), SimpleNamespace(
            kind="head", checkpoint=str(tmp_path / ckpt), num_draft=3, scheme="chain"))
        runs.append([(r.token_ids, r.meta["accepted"]) for r in
                     eng.generate(prompts, params, progress=False)])
        logits.append(list(drafted))
        drafted.clear()
    assert runs[0] == runs[1]
    assert len(logits[0]) == len(logits[1]) > 3
    for a, b in zip(*logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
