"""Training data: verified, memory-mapped shards packed into token-budget micro-batches.

Order is a pure function of (seed, epoch): sequences are shuffled and packed greedily up to
`batch_tokens`; the epochs' micro-batches form one endless global sequence, and global
micro-batch j goes to rank j % world. A position is a count of global micro-batches, the
same for any world size, so a run resumed on another number of ranks with the same global
batch (world x grad_accum) sees the same data per step (train/state.py checks that).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from heads.batch import PackedBatch
from precompute.manifest import Manifest
from precompute.plan import plan_shards
from precompute.shard_io import Shard, read_shard


@dataclass
class SeqRef:
    shard: int
    start: int
    end: int


class ShardStore:
    """All sequences of one or more precompute output_dirs (`data.shards=a` or, quoted for Hydra, `data.shards='a,b'`:
    e.g. self-distilled answers beside original conversations); checksums verified once at
    open. Every dir must come from the same target and aux layers."""

    def __init__(self, shards_dir: str | Path, verify: bool = True) -> None:
        dirs = [Path(d.strip()) for d in str(shards_dir).split(",") if d.strip()]
        if not dirs:
            raise ValueError(f"data.shards={shards_dir!r} names no shard directory")
        self.dirs = dirs
        self.shards: list[Shard] = []
        self.seqs: list[SeqRef] = []
        self.manifest = None
        for d in dirs:
            man = Manifest.load(d / "manifest.json")
            if not man.complete:
                raise ValueError(f"{d}: precompute did not finish (manifest incomplete); "
                                 "rerun it to resume")
            if self.manifest is None:
                self.manifest = man
            elif list(man.aux_layers) != list(self.manifest.aux_layers):
                raise ValueError(f"{d}: aux layers {list(man.aux_layers)} differ from "
                                 f"{list(self.manifest.aux_layers)} in {dirs[0]}; data.shards "
                                 "dirs must be precomputed with the same settings")
            self._check_same_target(d, man.target)
            for e in man.shards:
                shard = read_shard(d / e.file, e.sha256 if verify else None)
                cu = shard.cu_seqlens.tolist()
                self.seqs.extend(SeqRef(len(self.shards), a, b) for a, b in zip(cu[:-1], cu[1:]))
                self.shards.append(shard)
        if not self.seqs:
            raise ValueError(f"{shards_dir}: the shards hold no sequences")
        self.dir = dirs[0]

    def _check_same_target(self, d: Path, target: dict) -> None:
        first = self.manifest.target
        for key in ("weights_sha256", "frozen_sha256"):
            if key in first and key in target and first[key] != target[key]:
                raise ValueError(f"{d} was precomputed from other target weights than "
                                 f"{self.dirs[0]} ({key} {target[key][:12]} != "
                                 f"{first[key][:12]}); data.shards dirs must share one target")

    @property
    def aux_layers(self) -> list[int]:
        return list(self.manifest.aux_layers)

    def check_target(self, identity: dict) -> None:
        """Refuse shards made from another target: arch and weights fingerprint must match."""
        m = self.manifest.target
        if m.get("arch", {}).get("hidden_size") != identity["arch"]["hidden_size"] or \
                m.get("arch", {}).get("vocab_size") != identity["arch"]["vocab_size"]:
            raise ValueError(f"shards in {self.dir} were made from target {m.get('name')!r} "
                             f"(hidden {m.get('arch', {}).get('hidden_size')}), not from "
                             f"{identity['name']!r} (hidden {identity['arch']['hidden_size']})")
        for key in ("frozen_sha256", "weights_sha256"):
            if key in m and key in identity and m[key] != identity[key]:
                raise ValueError(f"shards in {self.dir} were made from different target weights "
                                 f"({key} {m[key][:12]} != {identity[key][:12]} of "
                                 f"{identity['name']!r}); precompute again for this target")

    def batches(self, batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
        """Sequence indices per micro-batch for one epoch (deterministic)."""
        return plan_epoch([s.end - s.start for s in self.seqs], batch_tokens, seed, epoch)

    def tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [N], loss_mask [N]) of every sequence (the draft vocabulary's counts)."""
        return (torch.cat([s.input_ids for s in self.shards]),
                torch.cat([s.loss_mask for s in self.shards]))

    def collate(self, seq_ids: list[int], dtype: torch.dtype = torch.float32) -> PackedBatch:
        parts = [(self.shards[self.seqs[i].shard], self.seqs[i].start, self.seqs[i].end) for i in seq_ids]
        ids = torch.cat([s.input_ids[a:b] for s, a, b in parts]).long()
        mask = torch.cat([s.loss_mask[a:b] for s, a, b in parts]).bool()
        hidden = torch.cat([_dequant(s, a, b, dtype) for s, a, b in parts])
        aux = None
        if parts[0][0].aux_hidden is not None:
            aux = torch.cat([s.aux_hidden[a:b].to(dtype) for s, a, b in parts])
        return PackedBatch(ids, hidden, mask, [b - a for _, a, b in parts], aux)


def plan_epoch(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """The micro-batches of one epoch over sequences of `lengths` (their order in the data):
    a pure function of the lengths, seed and epoch, so shards and online training
    (train/online.py) that hold the same sequences in the same order get the same batches."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    # Same greedy in-order packing as precompute's shard plan, over the shuffled order.
    groups = plan_shards([lengths[i] for i in order], batch_tokens)
    return [[order[j] for j in group] for group in groups]


def draw_seed(seed: int, index: int) -> int:
    """The seed of global micro-batch `index`'s random draws (PackedBatch.draw_seed): a pure
    function of the run's seed and the index, so whichever rank or accumulation step takes
    the micro-batch, and whether the run was resumed, it draws the same. Distinct for seeds
    below 2^23 and indices below 2^40, and within a torch generator's range for any seed."""
    return (seed * (1 << 40) + index) % (1 << 63)


def _dequant(s: Shard, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
    h = s.hidden[a:b].to(dtype)
    if s.hidden_scale is not None:
        h = h * s.hidden_scale[a:b].to(dtype).unsqueeze(-1)
    return h


class MicroBatchStream:
    """Endless rank-local micro-batches: rank r of W takes global micro-batches r, r+W, ...

    Epochs follow each other without a gap (no micro-batch is dropped to even out ranks: the
    sequence never ends, so every rank always has its next one). `position` is the number of
    global micro-batches the ranks have taken together (each rank took position / W)."""

    def __init__(self, store: ShardStore, batch_tokens: int, seed: int, rank: int, world: int,
                 position: int = 0) -> None:
        if position % world:
            raise ValueError(f"data position {position} is not a multiple of the world size {world}")
        self.store, self.batch_tokens, self.seed = store, batch_tokens, seed
        self.rank, self.world = rank, world
        self._next = position + rank  # global index this rank takes next
        self.last_index: int | None = None  # global index of the micro-batch next() gave
        self.epoch, self._epoch_start = 0, 0
        self._epoch_batches = store.batches(batch_tokens, seed, 0)

    @property
    def position(self) -> int:
        return self._next - self.rank

    def next(self) -> list[int]:
        """The sequence indices of this rank's next micro-batch; its global index is then
        `last_index`."""
        idx = self.last_index = self._next
        self._next += self.world
        while idx >= self._epoch_start + len(self._epoch_batches):
            self._epoch_start += len(self._epoch_batches)
            self.epoch += 1
            self._epoch_batches = self.store.batches(self.batch_tokens, self.seed, self.epoch)
        return self._epoch_batches[idx - self._epoch_start]
