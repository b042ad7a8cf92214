"""Hidden states captured while the engine generates equal a separate prefill over prompt +
answer (inference_eval/engine/capture.py), and the distill stage writes shards from them in
one pass (precompute/capture.py, precompute/distill/shards.py)."""
from __future__ import annotations

import pytest
import torch

from inference_eval.engine.attention import BatchLayout, make_backend
from inference_eval.engine.capture import CaptureSpec
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.llm_engine import LLMEngine
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.target import load_target
from inference_eval.hydra_app import compose
from precompute.config import PrecomputeConfig
from precompute.manifest import Manifest
from precompute.shard_io import read_shard

PROMPTS = ["hello there", "What does a draft head do in speculative decoding?", "2+2?"]


def _target(*overrides):
    cfg = compose("precompute", PrecomputeConfig, list(overrides))
    return load_target(cfg.target, device=torch.device("cpu"))


@pytest.mark.parametrize("overrides", [
    ["target=tiny", "target.arch.tie_word_embeddings=false"], ["target=smollm2"]],
    ids=["tiny", "smollm2"])
def test_captured_states_equal_a_prefill_over_prompt_and_answer(overrides):
    loaded = _target(*overrides)
    aux = [0, loaded.model.arch.num_layers - 1]
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    plain = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=2))
    want = plain.generate(PROMPTS, params, progress=False)
    eng = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(max_batch_size=2),
                    capture=CaptureSpec(aux, torch.float32))
    got = eng.generate(PROMPTS, params, progress=False)
    backend = make_backend("auto", torch.device("cpu"), torch.float32)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids  # capture changes nothing in the greedy answer
        ids = g.prompt_ids + g.token_ids
        assert g.hidden.shape == (len(ids), loaded.model.arch.hidden_size)
        assert g.aux.shape == (len(ids), 2, loaded.model.arch.hidden_size)
        with torch.inference_mode():
            ref = loaded.model(torch.tensor(ids), backend.plan(BatchLayout.packed([len(ids)])),
                               None, compute_logits=False, aux_layers=aux)
        # fp32 summation order only: decode rows run other kernels than a prefill's.
        scale = float(ref.hidden.abs().max())
        torch.testing.assert_close(g.hidden, ref.hidden, rtol=1e-4, atol=1e-5 * scale)
        torch.testing.assert_close(g.aux, ref.aux, rtol=1e-4, atol=1e-5 * scale)


def test_a_preempted_request_recaptures_from_its_first_token():
    """A cache too small for both requests: one is preempted and recomputed; its rows still
    cover every token once, equal to a prefill."""
    loaded = _target("target=tiny", "target.arch.tie_word_embeddings=false")
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    eng = LLMEngine(loaded.model, loaded.tokenizer,
                    EngineConfig(max_batch_size=2, num_pages=5, page_size=16),
                    capture=CaptureSpec((), torch.float32))
    got = eng.generate(PROMPTS[:2], params, progress=False)
    assert any(g.num_preemptions for g in got)
    backend = make_backend("auto", torch.device("cpu"), torch.float32)
    for g in got:
        ids = g.prompt_ids + g.token_ids
        with torch.inference_mode():
            ref = loaded.model(torch.tensor(ids), backend.plan(BatchLayout.packed([len(ids)])),
                               None, compute_logits=False)
        torch.testing.assert_close(g.hidden, ref.hidden, rtol=1e-4, atol=1e-4)


def test_distill_writes_checksummed_shards_in_one_pass(tmp_path, chats):
    """precompute.distill shards_dir=...: shards whose rows are the answered tokens (prompt
    ids + generated ids), answer tokens in the loss, verified by sha256 on read."""
    import precompute.distill.run as distill_run
    from precompute.distill import DistillConfig

    out = tmp_path / "d"
    cfg = compose("distill", DistillConfig, [
        "target=tiny", "target.arch.tie_word_embeddings=false", "data=jsonl",
        f"data.path={chats}", "data.limit=5", "engine.max_batch_size=2",
        "sampling.max_new_tokens=8", "progress=false", f"output_dir={out}",
        f"shards_dir={out}", "aux='0,1'", "hidden_dtype=float32"])
    distill_run.main(cfg)
    m = Manifest.load(out / "manifest.json")
    assert m.complete and m.aux_layers == [0, 1] and len(m.shards) == 3  # 5 prompts, batches of 2
    assert m.data["load_report"]["kept"] == sum(e.sequences for e in m.shards) == 5
    for e in m.shards:
        shard = read_shard(out / e.file, e.sha256)
        assert shard.aux_hidden.shape[1:] == (2, 64)
        cu = shard.cu_seqlens.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            mask = shard.loss_mask[a:b].tolist()
            assert mask[-8:] == [1] * 8 and sum(mask) == 8  # the 8 generated tokens, only
    assert not list(out.glob(".shards.rank*"))
