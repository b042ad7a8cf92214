"""One model call from the leader to the other ranks of a replica, as ONE broadcast of one
packed int64 tensor (growing, rarely, by a resize message first).

What a follower needs to run the same call: which model (the target, or the draft head that
shares its sharded embedding and lm_head), the input token ids, the layout (query and KV
lengths, block tables, page size, explicit positions, tree masks), which rows get logits,
which layers' outputs are kept; for a head call also its float input state and draft step.
Sampling settings, requests and page allocation stay on the leader: followers hold no request
state, only their KV cache shards, written at the slots the leader's block tables name.
Sampled tokens need not travel back: the next call's ids carry them. Target cache slot moves
(a tree round compacting its accepted path) ride on the next call: followers apply them first.

Packed layout (int64): [used, kind, T, B, N, compute_logits, A, has_positions, page_size, P,
model, M, S, state_rows, state_cols, state_dtype, k, moves]
then ids[T], q_lens[B], kv_lens[B], table_lens[B], tables[P], logits_indices[N], aux[A],
positions[T if has_positions], tree masks[M] (per request: its mask's columns m, -1 for no
mask, then q_len x m entries 0/1; M = -1: no masks), state[S] (the float state bit-cast to
int64 words, zero-padded to whole words), move sources[moves], move destinations[moves].
N = -1: logits for every row; P = -1: a cacheless layout (block_tables None: a packed prefill
over whole sequences, precompute's dump), which the followers run without their KV cache;
B = -1: no layout at all (a Medusa head call: no attention).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_eval.engine.attention.layout import BatchLayout
from inference_eval.engine.parallel import comm
from inference_eval.engine.parallel.group import TPGroup

STOP, STEP, RESIZE = 0, 1, 2
TARGET, HEAD = 0, 1  # which model a call runs (followers keep a registry of both)
HEADER = 18
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
EMPTY = torch.zeros(0, dtype=torch.long)


@dataclass
class StepMessage:
    """A model call: model(input_ids, backend.plan(layout), cache, logits_indices=...,
    compute_logits=..., aux_layers=...) for the target; drafter.run(input_ids, state,
    backend.plan(layout), logits_indices, k) for the head. input_ids [T] int64;
    logits_indices [N] or None; state [T, W] float or None; moves: (src [M], dst [M]) target
    cache slots to copy before the call (KVCache.copy_slots), or None."""

    input_ids: torch.Tensor
    layout: BatchLayout | None
    logits_indices: torch.Tensor | None
    compute_logits: bool
    aux_layers: tuple[int, ...]
    model: int = TARGET
    state: torch.Tensor | None = None
    k: int = 1
    moves: tuple[torch.Tensor, torch.Tensor] | None = None

    def pack(self, device: torch.device | None = None) -> torch.Tensor:
        """The call as one int64 tensor on `device` (default cpu). Tensors already there
        (a head's state and rows, tree masks, slot moves on the GPU) stay there: the leader
        sends a call without reading anything back from the device (the sync-free round)."""
        dev = torch.device("cpu") if device is None else device
        lay = self.layout
        ids = self.input_ids.reshape(-1)
        t = ids.numel()
        b = -1 if lay is None else len(lay.q_lens)
        cacheless = lay is None or lay.block_tables is None
        tables = [] if cacheless else [p for table in lay.block_tables for p in table]
        logits = None if self.logits_indices is None else self.logits_indices.reshape(-1)
        pos = None if lay is None else lay.positions
        masks = _pack_masks(lay, dev)
        state, rows, cols, code = _pack_state(self.state)
        src, dst = (EMPTY, EMPTY) if self.moves is None else (
            self.moves[0].reshape(-1).long(), self.moves[1].reshape(-1).long())
        head = [0, STEP, t, b, -1 if logits is None else logits.numel(), int(self.compute_logits),
                len(self.aux_layers), int(pos is not None), 0 if lay is None else lay.page_size,
                -1 if cacheless else len(tables), self.model,
                -1 if masks is None else masks.numel(), state.numel(), rows, cols, code, self.k,
                src.numel()]
        meta = []
        if lay is not None:
            lens = [0] * b if cacheless else [len(x) for x in lay.block_tables]
            meta = list(lay.q_lens) + list(lay.kv_lens) + lens + tables
        host = torch.tensor(head + meta, dtype=torch.long)
        parts = [host[:HEADER], ids.long(), host[HEADER:]]
        if logits is not None:
            parts.append(logits.long())
        parts.append(torch.tensor(list(self.aux_layers), dtype=torch.long))
        if pos is not None:
            parts.append(pos.reshape(-1).long())
        if masks is not None:
            parts.append(masks)
        parts += [state, src, dst]
        # Host parts go up without a sync (staged at once); device parts stay where they are.
        flat = torch.cat([x.to(dev, non_blocking=True) for x in parts])
        flat[0] = flat.numel()
        return flat

    @classmethod
    def unpack(cls, buf: torch.Tensor, device: torch.device) -> "StepMessage":
        h = buf[:HEADER].tolist()
        (_, _, t, b, n, logits_on, a, has_pos, page_size, p, model, m, s, rows, cols, code, k,
         nmoves) = h
        at = HEADER
        ids = buf[at:at + t]
        at += t
        layout = None
        if b >= 0:
            cacheless, p = p < 0, max(p, 0)
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
        positions = None
        if has_pos:
            positions = buf[at:at + t].clone().to(device)
            at += t
        masks = None
        if m >= 0:
            masks = _unpack_masks(buf[at:at + m], q_lens, device)
            at += m
        state = None
        if s:
            words = buf[at:at + s].clone()
            state = words.view(DTYPES[code]).reshape(-1)[:rows * cols].view(rows, cols).to(device)
            at += s
        moves = None
        if nmoves:
            moves = (buf[at:at + nmoves].to(device), buf[at + nmoves:at + 2 * nmoves].to(device))
        if b >= 0:
            layout = BatchLayout(q_lens=q_lens, kv_lens=kv_lens,
                                 block_tables=None if cacheless else tables,
                                 page_size=page_size, positions=positions, tree_masks=masks)
        return cls(ids.to(device), layout, logits, bool(logits_on), aux, model, state, k, moves)


def _pack_masks(lay: BatchLayout | None, dev: torch.device) -> torch.Tensor | None:
    """Per request [m, q_len * m entries] (m = -1: causal), or None without tree masks."""
    if lay is None or lay.tree_masks is None:
        return None
    parts = []
    for tm in lay.tree_masks:
        if tm is None:
            parts.append(torch.tensor([-1], device=dev))
            continue
        parts += [torch.tensor([tm.shape[1]], device=dev), tm.reshape(-1).to(dev).long()]
    return torch.cat(parts)


def _unpack_masks(flat: torch.Tensor, q_lens: list[int], device) -> list[torch.Tensor | None]:
    out, at = [], 0
    for q in q_lens:
        m = int(flat[at])
        at += 1
        if m < 0:
            out.append(None)
            continue
        out.append(flat[at:at + q * m].view(q, m).bool().to(device))
        at += q * m
    return out


def _pack_state(state: torch.Tensor | None) -> tuple[torch.Tensor, int, int, int]:
    """A float [R, C] state -> (int64 words on its device, R, C, dtype code): its bytes
    bit-cast, so a head call stays one broadcast (no float side channel)."""
    if state is None:
        return EMPTY, 0, 0, 0
    x = state.detach().reshape(state.shape[0], -1).contiguous()
    rows, cols = x.shape
    per_word = 8 // x.element_size()
    flat = x.reshape(-1)
    pad = -flat.numel() % per_word
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(torch.int64), rows, cols, DTYPES.index(x.dtype)


class StepChannel:
    """The leader's send() and the followers' recv() of one replica, in lockstep.
    `moves`: target cache slot moves the leader recorded since its last call (they ride on
    the next one)."""

    def __init__(self, tp: TPGroup, capacity: int = 256) -> None:
        self.tp = tp
        self.buf = self._alloc(max(capacity, HEADER))  # a stop or resize message always fits
        self.moves: list[tuple[torch.Tensor, torch.Tensor]] = []

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
        """Leader: the next model call (None: stop the followers), with the pending moves."""
        if msg is not None and self.moves:
            src, dst = zip(*self.moves)
            msg.moves = (torch.cat(src), torch.cat(dst))
            self.moves = []
        host = (torch.tensor([HEADER, STOP] + [0] * (HEADER - 2)) if msg is None
                else msg.pack(self.buf.device))
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
