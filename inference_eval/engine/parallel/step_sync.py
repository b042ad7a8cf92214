"""One step's metadata from the leader to the other ranks of a replica, as ONE broadcast of
one packed int64 tensor (growing, rarely, by a resize message first).

What a follower needs to run the same model call: the input token ids, the layout (query and
KV lengths, block tables, page size, explicit positions), which rows get logits and which
layers' outputs are kept. Sampling settings, requests and page allocation stay on the leader:
followers hold no request state, only their KV cache shard, written at the slots the leader's
block tables name. Sampled tokens need not travel back: the next step's ids carry them.

Packed layout (int64): [used, kind, T, B, N, compute_logits, A, has_positions, page_size, P]
then ids[T], q_lens[B], kv_lens[B], table_lens[B], tables[P], logits_indices[N], aux[A],
positions[T if has_positions]. N = -1: logits for every row.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_eval.engine.attention.layout import BatchLayout
from inference_eval.engine.parallel import comm
from inference_eval.engine.parallel.group import TPGroup

STOP, STEP, RESIZE = 0, 1, 2
HEADER = 10


@dataclass
class StepMessage:
    """A model call: model(input_ids, backend.plan(layout), cache, logits_indices=...,
    compute_logits=..., aux_layers=...). input_ids [T] int64; logits_indices [N] or None."""

    input_ids: torch.Tensor
    layout: BatchLayout
    logits_indices: torch.Tensor | None
    compute_logits: bool
    aux_layers: tuple[int, ...]

    def pack(self) -> torch.Tensor:
        lay = self.layout
        if lay.tree_masks is not None:
            raise NotImplementedError("tree masks under engine.tensor_parallel > 1 are not "
                                      "supported yet (tree speculation: use tensor_parallel=1)")
        if lay.block_tables is None:
            raise NotImplementedError("cacheless layouts under engine.tensor_parallel > 1 are "
                                      "not supported yet")
        ids = self.input_ids.reshape(-1).cpu()
        t, b = ids.numel(), len(lay.q_lens)
        tables = [p for table in lay.block_tables for p in table]
        logits = None if self.logits_indices is None else self.logits_indices.reshape(-1).cpu()
        pos = lay.positions
        head = [0, STEP, t, b, -1 if logits is None else logits.numel(), int(self.compute_logits),
                len(self.aux_layers), int(pos is not None), lay.page_size, len(tables)]
        meta = list(lay.q_lens) + list(lay.kv_lens) + [len(x) for x in lay.block_tables] + tables
        parts = [torch.tensor(head, dtype=torch.long), ids.long(),
                 torch.tensor(meta, dtype=torch.long)]
        if logits is not None:
            parts.append(logits.long())
        parts.append(torch.tensor(list(self.aux_layers), dtype=torch.long))
        if pos is not None:
            parts.append(pos.reshape(-1).cpu().long())
        flat = torch.cat(parts)
        flat[0] = flat.numel()
        return flat

    @classmethod
    def unpack(cls, buf: torch.Tensor, device: torch.device) -> "StepMessage":
        h = buf[:HEADER].tolist()
        _, _, t, b, n, logits_on, a, has_pos, page_size, p = h
        at = HEADER
        ids = buf[at:at + t]
        at += t
        meta = buf[at:at + 3 * b + p].tolist()
        q_lens, kv_lens, lens = meta[:b], meta[b:2 * b], meta[2 * b:3 * b]
        flat, tables = meta[3 * b:], []
        for n_pages in lens:
            tables.append(flat[:n_pages])
            flat = flat[n_pages:]
        at += 3 * b + p
        logits = None
        if n >= 0:
            logits = buf[at:at + n].to(device)
            at += n
        aux = tuple(buf[at:at + a].tolist())
        at += a
        positions = buf[at:at + t].clone() if has_pos else None
        layout = BatchLayout(q_lens=q_lens, kv_lens=kv_lens, block_tables=tables,
                             page_size=page_size, positions=positions)
        return cls(ids.to(device), layout, logits, bool(logits_on), aux)


class StepChannel:
    """The leader's send() and the followers' recv() of one replica, in lockstep."""

    def __init__(self, tp: TPGroup, capacity: int = 256) -> None:
        self.tp = tp
        self.buf = self._alloc(capacity)

    def _alloc(self, capacity: int) -> torch.Tensor:
        # A normal tensor even when it grows inside a step (inference mode): the stop message
        # is written outside one.
        with torch.inference_mode(False):
            return torch.zeros(capacity, dtype=torch.long, device=self.tp.device)

    def _broadcast(self, host: torch.Tensor | None) -> torch.Tensor:
        if host is not None:
            self.buf[:host.numel()].copy_(host)
        comm.broadcast(self.buf, self.tp)
        return self.buf

    def send(self, msg: StepMessage | None) -> None:
        """Leader: the next model call (None: stop the followers)."""
        host = torch.tensor([HEADER, STOP] + [0] * (HEADER - 2)) if msg is None else msg.pack()
        if host.numel() > self.buf.numel():
            cap = max(host.numel(), 2 * self.buf.numel())
            self._broadcast(torch.tensor([HEADER, RESIZE, cap] + [0] * (HEADER - 3)))
            self.buf = self._alloc(cap)
        self._broadcast(host)

    def recv(self) -> StepMessage | None:
        """Follower: the leader's next model call, or None when it stops."""
        while True:
            buf = self._broadcast(None).cpu()
            kind = int(buf[1])
            if kind == RESIZE:
                self.buf = self._alloc(int(buf[2]))
                continue
            if kind == STOP:
                return None
            return StepMessage.unpack(buf[:int(buf[0])], self.tp.device)
