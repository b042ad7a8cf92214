"""Hidden states captured while the engine generates (self-distillation without a second pass).

Every step already computes the last decoder layer's output h_t (pre final norm) for each row
it processes: a prefill's prompt rows, a decode step's one new row. With capture on, the engine
keeps those rows per request, cast to `dtype` on the CPU, so a finished request carries
hidden [L, H] (and aux [L, A, H] for `aux_layers`) for all of its tokens x_0..x_{L-1}: the same
states a separate packed prefill over prompt + answer would give (up to summation order).

The last sampled token is never fed to the model by plain generation; with capture on, a
finished request runs one more single-row step (`Request.draining`) that computes its state
and samples nothing. A preempted request is recomputed from its tokens, so its rows restart
from position 0 (`HiddenCapture.add` sees the first cache index and cuts the buffer there).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class CaptureSpec:
    """What to keep: `aux_layers` (0-based decoder layers whose outputs go in `aux`) and the
    dtype rows are cast to when copied off the device (the shards' storage dtype)."""

    aux_layers: Sequence[int] = ()
    dtype: torch.dtype = torch.float32


@dataclass
class _Rows:
    hidden: list[torch.Tensor] = field(default_factory=list)
    aux: list[torch.Tensor] = field(default_factory=list)
    count: int = 0


class HiddenCapture:
    """Per-request buffers of captured rows, filled step by step."""

    def __init__(self, spec: CaptureSpec) -> None:
        self.spec = spec
        self.aux_layers = tuple(spec.aux_layers)
        self._rows: dict[int, _Rows] = {}

    def add(self, rid: int, first: int, hidden: torch.Tensor, aux: torch.Tensor | None) -> None:
        """Rows of request `rid` at cache indices first .. first + n: hidden [n, H],
        aux [n, A, H] or None. first == 0 (a prefill or a recompute) starts over."""
        rows = self._rows.get(rid)
        if rows is None or first == 0:
            rows = self._rows[rid] = _Rows()
        if first != rows.count:
            raise RuntimeError(f"request {rid}: captured {rows.count} rows, the step starts at "
                               f"cache index {first}")
        rows.hidden.append(hidden.to("cpu", self.spec.dtype))
        if aux is not None:
            rows.aux.append(aux.to("cpu", self.spec.dtype))
        rows.count += hidden.shape[0]

    def pop(self, rid: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(hidden [L, H], aux [L, A, H] or None) of a finished request; buffers freed."""
        rows = self._rows.pop(rid, None)
        if rows is None or not rows.hidden:
            return None, None
        aux = torch.cat(rows.aux) if rows.aux else None
        return torch.cat(rows.hidden), aux
