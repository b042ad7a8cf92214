"""Validation with the real inference implementation, on held-out conversations.

No precomputed states: the engine's target model recomputes the hidden states, the head's
rollout runs on them (all K steps), and step 1 additionally runs through the engine's paged
KV-cache attention, the path serving uses. On the first user turns of a few of those
conversations the head then drafts for real (inference_eval's speculative engine, greedy, a
chain of K drafts), which gives the measured τ and α_k beside the teacher-forced expectations
(docs/evaluation.md), so differences between training and serving numerics show up.

The loop owns one Validator (target and data are loaded once) and calls it on rank 0; with
engine.tensor_parallel=T > 1 every trainer rank takes part through train/tp_validation.py,
which runs the same measurements over the target's and the head's shards.
"""
from __future__ import annotations

import contextlib
import tempfile
from types import SimpleNamespace
from typing import Callable

import torch

from heads.base import DraftHead
from heads.batch import PackedBatch
from heads.checkpoint import save_head
from heads.objective import summarize
from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionBackend
from inference_eval.engine.kv_cache import KVCache
from inference_eval.engine.model.transformer import StepContext
from inference_eval.engine.target import LoadedTarget, load_target
from precompute.data import DataConfig, load_conversations, tokenize_conversations
from train.config import TrainConfig


def head_draft(checkpoint: str, k: int):
    """The real-τ run's draft: the head checkpoint as a greedy chain of k drafts."""
    from inference_eval.evaluation.config import DraftConfig

    return DraftConfig(kind="head", name="val", checkpoint=checkpoint, scheme="chain", num_draft=k)


class Validator:
    def __init__(self, cfg: TrainConfig, loaded: LoadedTarget | None = None) -> None:
        """loaded: the target to validate with; default cfg.target, loaded whole on the
        engine's device (under tensor parallelism: the leader's shard, tp_validation.py)."""
        v = cfg.validation
        self.engine_cfg = cfg.engine
        self.loaded = loaded if loaded is not None else load_target(
            cfg.target, device=cfg.engine.resolve_device())
        self.device = next(self.loaded.model.parameters()).device
        data = DataConfig(source="sharegpt" if v.path is None or v.path.endswith(".json") else "jsonl",
                          path=v.path, skip=v.skip, limit=v.num_conversations, max_length=v.max_length)
        convs = load_conversations(data).conversations
        self.records = list(tokenize_conversations(self.loaded.tokenizer, convs, v.max_length))
        if not self.records:
            raise ValueError("validation found no held-out conversations; check validation.skip/path")
        self.backend = TorchAttentionBackend(self.device)
        # τ prompts: each conversation up to its first assistant token (the chat template's
        # assistant header included), as token ids, so the engine sees exactly these tokens.
        firsts = [(r, r.loss_mask.index(1)) for r in self.records if 1 in r.loss_mask]
        self.tau_prompts = [list(r.input_ids[:i]) for r, i in firsts if i > 0][:v.tau_prompts]
        if v.tau_prompts_path is not None and v.tau_prompts:
            self.tau_prompts = _file_prompts(v.tau_prompts_path, self.loaded.tokenizer, v.tau_prompts)
        self.tau_max_new_tokens = v.tau_max_new_tokens
        self.tau_k = v.tau_num_draft

    def __call__(self, head: DraftHead,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                 ) -> dict:
        """Metrics of `head` (a full, unsharded head). `autocast`: the training loop's autocast,
        so the teacher-forced numbers use training numerics; the engine runs without it."""
        return self.measure(head, autocast, self.loaded.model, self._spec_engine)

    def measure(self, head: DraftHead, autocast, target, spec_engine: Callable) -> dict:
        """__call__'s metrics with the target and engine given: target(ids, plan, None,
        compute_logits=False, aux_layers=...) runs the teacher-forced forwards (the model, or
        the tensor-parallel leader's TPLeader, whose followers run their shards);
        spec_engine(head, k) -> the speculative engine drafting a greedy chain of k with
        `head` (k = chain_k(head))."""
        was_training = head.training
        head.eval()
        try:
            with torch.no_grad():
                result = self._teacher_forced(head, autocast, self.records, target)
            if self.tau_prompts:
                real, outputs = self._real_tau(head, spec_engine)
                result.update(real)
                # The same expectation on the very text the engine just generated (prompt +
                # greedy answer, loss on the answer): beside real τ, it isolates train/serve
                # differences from the held-out data's own off-policy text.
                k_train, head.cfg.num_steps = head.cfg.num_steps, self.chain_k(head)
                try:  # the rollout as deep as the chain the engine drafted
                    with torch.no_grad():
                        tf = self._teacher_forced(head, autocast, outputs, target,
                                                  engine_check=False)
                finally:
                    head.cfg.num_steps = k_train
                result.update({"tf_outputs_exp_tau_greedy": tf["exp_tau_greedy"],
                               "tf_outputs_exp_accept_greedy": tf["exp_accept_greedy"]})
        finally:
            head.train(was_training)
        return result

    def chain_k(self, head: DraftHead) -> int:
        """K of the real-τ chain: validation.tau_num_draft, else the head's num_steps."""
        return self.tau_k or head.cfg.num_steps

    # ---- teacher-forced: expected acceptance, and step 1 through the paged KV cache -------
    def _teacher_forced(self, head: DraftHead, autocast, records, model,
                        engine_check: bool = True) -> dict:
        """Teacher-forced metrics over `records` (TokenizedRecord-like: input_ids, loss_mask)
        with the target forwards of `model`; engine_check: also run step 1 through the
        engine's paged attention and compare."""
        dev = head.rope_cos.device
        aux_layers = list(head.cfg.aux_layers) if head.cfg.reads_aux else []
        total = None
        diffs = []
        engine_stats = torch.zeros(3)
        for rec in records:
            n = len(rec.input_ids)
            ids = torch.tensor(rec.input_ids, dtype=torch.long, device=self.device)
            out = model(ids, self.backend.plan(BatchLayout.packed([n])), None, compute_logits=False,
                        aux_layers=aux_layers)
            ids, hidden = ids.to(dev), out.hidden.to(dev, torch.float32)
            aux = None if out.aux is None else out.aux.to(dev, torch.float32)
            mask = torch.tensor(rec.loss_mask, dtype=torch.bool, device=dev)
            batch = PackedBatch(ids, hidden, mask, [n], aux)
            with autocast():  # the head only: the target's states are the engine's, as in precompute
                _, stats = head(batch)
                total = stats.float().cpu() if total is None else total + stats.float().cpu()
                if not (head.uses_tokens and engine_check and head.drafting != "block"):
                    continue
                first = head.first_hidden(hidden, aux)
                feats = self._engine_step1(head, ids, first)
                ref = head.step(torch.cat([ids[1:], ids[:1] * 0]), first, _rollout_ctx(head, n))[1]
                diffs.append(float((feats[:-1] - ref[:-1]).float().abs().max()))
                engine_stats += _step1_metrics(head, feats, hidden, batch)
        result = summarize(total)
        if diffs:
            rows = engine_stats[2].clamp(min=1)
            result["engine_step1_top1_acc"] = float(engine_stats[0] / rows)
            result["engine_step1_exp_accept_sampled"] = float(engine_stats[1] / rows)
            result["engine_vs_rollout_max_abs_diff"] = max(diffs)
        result["num_tokens"] = int(total[0, 3])
        return result

    def _engine_step1(self, head: DraftHead, ids: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Step-1 features [n, H] through a paged KV cache, as the engine drafts."""
        a, n, page, dev = head.arch, ids.numel(), 16, ids.device
        pages = -(-n // page)
        cache = KVCache.for_arch(a, pages, page, dtype=first.dtype, device=dev)
        plan = TorchAttentionBackend(dev).plan(BatchLayout([n], [n], [list(range(pages))[::-1]], page))
        ctx = StepContext(head.rope_cos[plan.positions], head.rope_sin[plan.positions], plan, cache)
        tokens = torch.cat([ids[1:], ids[:1] * 0])  # x_{t+1}; the last row has no next token
        return head.step(tokens, first, ctx)[1]

    # ---- real speculative decoding --------------------------------------------------------
    def _spec_engine(self, head: DraftHead, k: int):
        """The engine the eval CLI builds (inference_eval's build_engine): the head goes
        through a head checkpoint, as it would be served."""
        from inference_eval.evaluation.engines import build_engine

        with tempfile.TemporaryDirectory(prefix="specheads_val_head_") as tmp:
            save_head(head, tmp)
            return build_engine(self.loaded, self.engine_cfg, head_draft(tmp, k))  # reads it now

    def _real_tau(self, head: DraftHead, spec_engine: Callable) -> dict:
        """Greedy chain speculation with spec_engine(head, k)."""
        from inference_eval.evaluation.metrics import TurnOutput
        from inference_eval.evaluation.metrics import summarize as summarize_outputs
        from inference_eval.engine.sampling import SamplingParams

        k = self.chain_k(head)
        engine = spec_engine(head, k)
        params = SamplingParams(temperature=0.0, max_new_tokens=self.tau_max_new_tokens)
        results = engine.generate(self.tau_prompts, params, chat=False, progress=False)
        del engine  # its KV cache
        outputs = [TurnOutput.from_result(str(i), "validation", 0, r) for i, r in enumerate(results)]
        s = summarize_outputs(outputs, k)
        generated = [SimpleNamespace(input_ids=p + list(r.token_ids),
                                     loss_mask=[0] * len(p) + [1] * len(r.token_ids))
                     for p, r in zip(self.tau_prompts, results) if r.token_ids]
        return {"real_tau": s["mean_accept_len"],
                "real_per_position_accept_rate": s["per_position_accept_rate"],
                "real_accept_len_hist": s["accept_len_hist"],
                "real_target_steps": s["target_steps"],
                "real_draft_steps": s["draft_steps"],
                "real_generated_tokens": s["generated_tokens"],
                "real_num_prompts": len(outputs), "real_num_errors": s["num_errors"]}, generated


def _file_prompts(source: str, tokenizer, limit: int) -> list[list[int]]:
    """First turns of the first `limit` prompts of a prompt set (heldout_mix, humaneval,
    sharegpt_heldout) or a prompt JSONL file, chat-templated to token ids the way the eval CLI
    encodes them."""
    from inference_eval.engine.prompt_encoding import encode_prompt
    from inference_eval.evaluation.prompts import PROMPT_SETS, PromptsConfig, load_prompts

    named = source in PROMPT_SETS and source != "jsonl"
    cfg = PromptsConfig(name=source, limit=limit, per_category=max(1, limit // 10)) if named \
        else PromptsConfig(name="jsonl", path=source, limit=limit)
    return [encode_prompt(tokenizer, it.turns[0]) for it in load_prompts(cfg)]


def _rollout_ctx(head: DraftHead, n: int):
    from heads.rollout_attention import RolloutContext, RolloutPlan

    return RolloutContext(RolloutPlan([n]), head.rope_cos, head.rope_sin)


def _step1_metrics(head: DraftHead, feats: torch.Tensor, hidden: torch.Tensor,
                   batch: PackedBatch) -> torch.Tensor:
    """[top-1 matches, sum min(p,q), rows] for step 1 from engine-path features."""
    n = feats.shape[0]
    if n < 3:
        return torch.zeros(3)
    valid = batch.loss_mask[2:].clone()
    q = torch.softmax(head.logits(feats[:n - 2]).float(), -1)
    p = torch.softmax(head.frozen.logits(hidden[1:n - 1]).float(), -1)
    d2t = head.draft_to_target()
    if d2t is not None:
        p = p[:, d2t] / p[:, d2t].sum(-1, keepdim=True)
    match = (q.argmax(-1) == p.argmax(-1))[valid].float().sum()
    return torch.stack([match, torch.minimum(p, q).sum(-1)[valid].sum(), valid.float().sum()]).cpu()
