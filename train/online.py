"""Online training (`data.online=true source=<data group>`): the target runs in the training job
and hands each micro-batch's hidden states to the trainer; nothing is dumped.

    python -m train target=smollm2 head=mtp data.online=true source=sharegpt source.limit=300
    python -m train target=smollm2 head=mtp data.online=true source=mix source.limit=300 \
        source.regenerate=true

`OnlineSource` has ShardStore's interface (batches, collate, tokens, aux_layers, check_target),
and the same batches: the order is `train.data.plan_epoch` over the records' lengths in the
order the shards of the same data would hold them. docs/online.md has the design; in short:

- Without regeneration the records are precompute's (same loading, chat template, rejects),
  so their lengths are known before any forward. A micro-batch's states come from the same
  forwards precompute's dump makes: the record's batch of precompute's plan (shard_tokens,
  forward_tokens = precompute's batch_tokens) through precompute.dump.forward_batch, cast to
  hidden_dtype. A record's states depend on the batch it runs in (the CPU kernels' row
  blocking), so this, not a forward of the micro-batch, is what makes them the shards' bits.
  The other records of such a batch wait in a cache of `cache_tokens` tokens; past it the
  oldest are dropped and recomputed when their micro-batch comes (the same bits again).
- With regeneration (source.regenerate=true) lengths exist only after the answers, so the
  target first answers every prompt with capture on (precompute/distill/memory.py: the
  distill stage's batches, seeds and record rules) and the states it computed while
  generating are kept in memory: those are the bits `precompute data.regenerate=true` writes.
  Under torchrun each rank answers its share and the records are gathered on every rank.

With engine.tensor_parallel=T > 1 each group of T ranks shares one target split over them
(train/online_tp.py, TPOnlineSource): its leader runs the forwards or the generation, and the
group's ranks get their rows from it. The trainer stays data parallel over all ranks.

Resume: the data position of the checkpoint is a count of micro-batches of that fixed plan;
a resumed run rebuilds the plan (regeneration answers again: the same requests, the same
bits) and continues at the position, so no record is repeated or skipped.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import replace

import torch

from heads.batch import PackedBatch
from inference_eval.engine.attention import make_backend
from inference_eval.engine.model.linear import openblas_threads, set_cpu_blas
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.target import load_target
from inference_eval.engine.threads import torch_threads
from precompute.capture import capture_dtype
from precompute.config import aux_layer_ids
from precompute.data import load_conversations, tokenize_conversations
from precompute.distill import DistillConfig
from precompute.distill.memory import answer_in_memory
from precompute.dump import forward_batch
from precompute.plan import plan_batches, plan_shards
from precompute.shard_io import quantize_fp8
from train.config import TrainConfig
from train.data import plan_epoch


class OnlineSource:
    """Records of cfg.source, their states computed by the target on `device`.

    Hooks a tensor-parallel source overrides (train/online_tp.py): _load (the target),
    _answer_share (this rank's answers), _rows (a micro-batch's stored states)."""

    leads = True  # runs the target's calls itself (a TP follower serves its leader's)

    def __init__(self, cfg: TrainConfig, device: torch.device, rank: int, world: int,
                 gather=None) -> None:
        d, self.source = cfg.data, cfg.source
        self.hidden_dtype, self.cache_tokens = d.hidden_dtype, d.cache_tokens
        self.store = capture_dtype(d.hidden_dtype)
        self.target_tokens, self.target_secs = 0, 0.0
        loaded = self._load(cfg, device)
        # Every rank tokenizes the records itself; with regeneration a TP follower gets
        # them from its leader's answers (the gather in _answer) and needs no tokenizer.
        if loaded.tokenizer is None and (self.leads or not cfg.source.regenerate):
            raise ValueError(f"target {cfg.target.name!r} has no tokenizer; data.online=true "
                             "tokenizes source records with it (set target.tokenizer)")
        self.model, self.identity = loaded.model, loaded.identity
        self.aux_layers = aux_layer_ids(online_aux(cfg), self.model.arch.num_layers, "data.aux")
        self.rejected: dict[str, int] = {}
        if cfg.source.regenerate:
            self._answer(cfg, loaded, rank, world, gather)
        else:
            self._tokenize(cfg, loaded.tokenizer)
            self.backend = make_backend(cfg.engine.attention, device,
                                        self.model.lm_head_weight.dtype)
            # The settings precompute's dump runs under (precompute/run.py).
            set_cpu_blas(self.model, device.type == "cpu"
                         and self.model.lm_head_weight.dtype == torch.float32
                         and cfg.engine.cpu_blas != "torch", codes=False)
            self._plan_forwards(d.shard_tokens, d.forward_tokens)
        if not self.lengths:
            raise ValueError(f"data.online: source={cfg.source.source} yielded no trainable "
                             f"record (rejected: {self.rejected}); check source.path/limit "
                             "and source.max_length")

    def _load(self, cfg: TrainConfig, device: torch.device):
        return load_target(cfg.target, device=device)

    # ---- records --------------------------------------------------------------------
    def _tokenize(self, cfg: TrainConfig, tok) -> None:
        result = load_conversations(cfg.source)
        self.records = list(tokenize_conversations(
            tok, result.conversations, cfg.source.max_length, cfg.source.system_prompt,
            report=result.report, rejected=result.rejected))
        self.rejected = dict(sorted(result.report.rejected.items()))
        self.lengths = [len(r.input_ids) for r in self.records]
        self.captured = None

    def _answer(self, cfg: TrainConfig, loaded, rank: int, world: int, gather) -> None:
        dcfg = distill_config(cfg)
        t0 = time.perf_counter()

        def count(prompts: int, tokens: int, secs: float) -> None:
            self.target_tokens += tokens

        mine, rejects = self._answer_share(dcfg, loaded, rank, world, count)
        self.target_secs += time.perf_counter() - t0
        if world > 1:  # every rank trains on micro-batches drawn from all records
            parts = gather((mine, rejects))
            mine = {f: recs for got, _ in parts for f, recs in got.items()}
            rejects = [r for _, rs in parts for r in rs]
        firsts = sorted(mine)  # the shards' order: batches by their first prompt
        self.captured = [c for f in firsts for c in mine[f]]
        self.records = [c.record for c in self.captured]
        self.lengths = [len(r.input_ids) for r in self.records]
        for r in rejects:
            self.rejected[r["reason"]] = self.rejected.get(r["reason"], 0) + 1
        self.rejected = dict(sorted(self.rejected.items()))

    def _answer_share(self, dcfg: DistillConfig, loaded, rank: int, world: int, count
                      ) -> tuple[dict, list]:
        """({first prompt of a batch: its records}, rejects) of data-parallel rank `rank`."""
        mine, rejects, _ = answer_in_memory(dcfg, loaded, rank, world, on_batch=count)
        return mine, rejects

    def _plan_forwards(self, shard_tokens: int, forward_tokens: int) -> None:
        """Record -> its forward batch of precompute's plan (plan_shards, plan_batches)."""
        self.forwards: list[list[int]] = []
        for shard in plan_shards(self.lengths, shard_tokens):
            self.forwards += plan_batches(shard, self.lengths, forward_tokens)
        self.forward_of = {i: k for k, b in enumerate(self.forwards) for i in b}
        self.cache: OrderedDict[int, tuple] = OrderedDict()
        self.cached_tokens = 0

    # ---- ShardStore's interface -----------------------------------------------------
    def check_target(self, identity: dict) -> None:
        """The frozen parts the head uses come from this same target config; refuse if not."""
        for key in ("hidden_size", "vocab_size"):
            if identity["arch"][key] != self.identity["arch"][key]:
                raise ValueError(f"data.online: the head's target has {key} "
                                 f"{identity['arch'][key]}, the online target "
                                 f"{self.identity['arch'][key]}")

    def batches(self, batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
        return plan_epoch(self.lengths, batch_tokens, seed, epoch)

    def tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor([t for r in self.records for t in r.input_ids]),
                torch.tensor([m for r in self.records for m in r.loss_mask], dtype=torch.uint8))

    def collate(self, seq_ids: list[int], dtype: torch.dtype = torch.float32) -> PackedBatch:
        """The micro-batch `seq_ids` with its states, as ShardStore.collate returns it."""
        rows = self._rows(seq_ids)
        recs = [self.records[i] for i in seq_ids]
        ids = torch.tensor([t for r in recs for t in r.input_ids], dtype=torch.long)
        mask = torch.tensor([m for r in recs for m in r.loss_mask], dtype=torch.bool)
        hidden = torch.cat([stored_float(h, self.hidden_dtype, dtype) for h, _ in rows])
        aux = torch.cat([a.to(dtype) for _, a in rows]) if rows[0][1] is not None else None
        return PackedBatch(ids, hidden, mask, [len(r.input_ids) for r in recs], aux)

    # ---- states ---------------------------------------------------------------------
    def _rows(self, seq_ids: list[int]) -> list[tuple]:
        """Stored (hidden, aux) per record of the micro-batch `seq_ids`."""
        return [self._states(i) for i in seq_ids]

    def _states(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.captured is not None:
            c = self.captured[i]
            return stored(c.hidden, self.hidden_dtype), stored_aux(c.aux, self.hidden_dtype)
        if i not in self.cache:
            self._forward(self.forward_of[i])
        h, a = self.cache.pop(i)
        self.cached_tokens -= h[0].shape[0] if isinstance(h, tuple) else h.shape[0]
        return h, a

    def _forward(self, k: int) -> None:
        batch = self.forwards[k]
        t0 = time.perf_counter()
        device = next(self.model.parameters()).device
        with torch_threads(openblas_threads(self.model.cpu_blas and device.type == "cpu")):
            rows = forward_batch(self.model, self.backend, [self.records[i] for i in batch],
                                 self.aux_layers, self.store)
        self.target_secs += time.perf_counter() - t0
        for i, (h, a) in zip(batch, rows):
            self.target_tokens += h.shape[0]
            if i not in self.cache:
                self.cache[i] = (stored(h, self.hidden_dtype), stored_aux(a, self.hidden_dtype))
                self.cached_tokens += h.shape[0]
        while self.cached_tokens > self.cache_tokens and len(self.cache) > 1:
            j, (h, _) = self.cache.popitem(last=False)  # recomputed when its turn comes
            self.cached_tokens -= h[0].shape[0] if isinstance(h, tuple) else h.shape[0]

    def rates(self) -> dict:
        return {"target_tokens": self.target_tokens, "target_secs": self.target_secs}


def stored(h: torch.Tensor, hidden_dtype: str):
    """States as a shard stores them: the dtype, or fp8 with per-token scales (dump.py)."""
    return quantize_fp8(h) if hidden_dtype == "fp8" else h


def stored_aux(a: torch.Tensor | None, hidden_dtype: str) -> torch.Tensor | None:
    return a.to(torch.bfloat16) if a is not None and hidden_dtype == "fp8" else a


def stored_float(h, hidden_dtype: str, dtype: torch.dtype) -> torch.Tensor:
    """ShardStore's dequantization (train/data.py _dequant), on stored states."""
    if hidden_dtype != "fp8":
        return h.to(dtype)
    q, scale = h
    return q.to(dtype) * scale.to(dtype).unsqueeze(-1)


def online_aux(cfg: TrainConfig) -> str:
    """data.aux, with "auto": the EAGLE-3 layers for a head that reads auxiliary layers
    (eagle3 and P-EAGLE, dflash), none otherwise."""
    if cfg.data.aux != "auto":
        return cfg.data.aux
    return "eagle3" if cfg.head.reads_aux else "none"


def distill_config(cfg: TrainConfig) -> DistillConfig:
    """The distill stage `precompute data.regenerate=true` runs for the same source: so the
    records, batches and seeds (and so the bits) are those of its shards."""
    s = cfg.source
    return DistillConfig(
        target=cfg.target, data=replace(s, regenerate=False), engine=cfg.engine,
        sampling=SamplingParams(temperature=s.regen_temperature,
                                max_new_tokens=s.regen_max_new_tokens),
        output_dir="(online)", turns="all", progress=False, shards_dir=None,
        hidden_dtype=cfg.data.hidden_dtype, aux=online_aux(cfg),
        shard_tokens=cfg.data.shard_tokens)


def online_source(cfg: TrainConfig, acc) -> OnlineSource:
    """The source on the trainer's device: every rank its own target (data parallel), or at
    engine.tensor_parallel=T > 1 its group's (train/online_tp.py); prints the records kept
    and rejected by reason, as precompute's summary does."""
    from train.distributed import gather_objects

    device = acc.device if acc is not None else torch.device("cpu")
    rank, world = (acc.process_index, acc.num_processes) if acc is not None else (0, 1)
    t0 = time.perf_counter()
    kind = OnlineSource
    if cfg.engine.tensor_parallel > 1:
        from train.online_tp import TPOnlineSource as kind  # (it imports this module)
    src = kind(cfg, device, rank, world, gather=gather_objects)
    if rank == 0:
        how = "answered and captured" if cfg.source.regenerate else "tokenized"
        print(f"online data ({how}): kept {len(src.lengths)} records, rejected "
              f"{sum(src.rejected.values())} {src.rejected}, {sum(src.lengths)} tokens, "
              f"{time.perf_counter() - t0:.1f}s; no hidden states written")
    return src


def online_progress(src: OnlineSource, bar, last: dict, tokens: int, t0: float) -> None:
    """Target tokens/s (its forwards or generation) and trainer tokens/s (the rest of the
    wall time) in the log line and on the progress bar."""
    wall = time.perf_counter() - t0
    last["target_tokens_per_s"] = src.target_tokens / max(src.target_secs, 1e-9)
    last["trainer_tokens_per_s"] = tokens / max(wall - src.target_secs, 1e-9)
    bar.set_postfix(loss=f"{last['loss']:.3f}", target_tok_s=f"{last['target_tokens_per_s']:.0f}",
                    train_tok_s=f"{last['trainer_tokens_per_s']:.0f}")


def check_warm_start_target(path: str, parts) -> None:
    """trainer.init_from must be a head of this target: refuse one whose config names other
    frozen weights or sizes before the target runs over the data."""
    from heads.checkpoint import read_head_config

    theirs = read_head_config(path).get("target") or {}
    mine = parts.identity
    for key in ("hidden_size", "vocab_size"):
        got = (theirs.get("arch") or {}).get(key)
        if got is not None and got != mine["arch"][key]:
            raise ValueError(f"trainer.init_from={path}: the head was trained for a target with "
                             f"{key} {got}, {mine['name']!r} has {mine['arch'][key]}; start "
                             "from a head of this target or drop trainer.init_from")
    if theirs.get("frozen_sha256") and theirs["frozen_sha256"] != mine.get("frozen_sha256"):
        raise ValueError(f"trainer.init_from={path}: the head was trained for other target "
                         f"weights ({theirs.get('name')!r}, frozen_sha256 "
                         f"{theirs['frozen_sha256'][:12]} != {mine['frozen_sha256'][:12]}); "
                         "start from a head of this target or drop trainer.init_from")
