"""Checkpoint selection by the engine-measured τ, early stopping, and the acceptance curve.

After each validation that measured real τ (greedy speculative decoding in the engine on
held-out prompts), the head is written to `output_dir/checkpoints/best/` when it beats every
earlier one, and the point (training tokens seen, real τ, α_k, expected τ) is appended to
`output_dir/acceptance_curve.json` and plotted to `acceptance_curve.png`, so a user sees
whether more data would still pay. With `trainer.early_stop_patience = n > 0` training stops
after n validations in a row without a better real τ. Everything here runs on rank 0; the
loop broadcasts the stop decision.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from heads.checkpoint import save_head

METRIC = "real_tau"


class Selection:
    def __init__(self, out: Path, patience: int = 0, min_delta: float = 0.0) -> None:
        self.out, self.patience, self.min_delta = out, patience, min_delta
        self.best_dir = out / "checkpoints" / "best"
        self.curve_path = out / "acceptance_curve.json"
        self.curve: list[dict] = []
        if self.curve_path.is_file():  # a resumed run continues its curve
            self.curve = json.loads(self.curve_path.read_text())["points"]

    @property
    def best(self) -> dict | None:
        scored = [p for p in self.curve if p.get(METRIC) is not None]
        return max(scored, key=lambda p: (p[METRIC], -p["step"])) if scored else None

    def update(self, step: int, tokens: int, val: dict, head) -> bool:
        """Record one validation; returns True when training should stop early."""
        point = {"step": step, "train_tokens": tokens, METRIC: val.get(METRIC),
                 "alpha": val.get("real_per_position_accept_rate"),
                 "exp_tau_greedy": val.get("exp_tau_greedy"),
                 "real_num_prompts": val.get("real_num_prompts")}
        self.curve = [p for p in self.curve if p["step"] < step] + [point]
        best = self.best
        if point[METRIC] is not None and best is point:
            save_head(head, self.best_dir, extra={"selection": {
                "metric": METRIC, "value": point[METRIC], "step": step, "train_tokens": tokens}})
        self._write()
        return self.should_stop()

    def should_stop(self) -> bool:
        if self.patience <= 0:
            return False
        scored = [p for p in self.curve if p.get(METRIC) is not None]
        if len(scored) <= self.patience:
            return False
        before = max(p[METRIC] for p in scored[:-self.patience])
        return max(p[METRIC] for p in scored[-self.patience:]) <= before + self.min_delta

    def _write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.curve_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"metric": METRIC, "best": self.best, "points": self.curve},
                                  indent=1))
        os.replace(tmp, self.curve_path)
        plot_curve(self.curve, self.out / "acceptance_curve.png")


def plot_curve(points: list[dict], path: Path) -> None:
    """Real τ and α_k against training tokens (log x), expected τ dashed beside real τ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in points if p.get(METRIC) is not None]
    if not pts:
        return
    x = [max(p["train_tokens"], 1) for p in pts]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.plot(x, [p[METRIC] for p in pts], "o-", label="real τ (engine)")
    exp = [p.get("exp_tau_greedy") for p in pts]
    if all(e is not None for e in exp):
        a1.plot(x, exp, "s--", label="expected τ (teacher-forced)")
    a1.set(xscale="log", xlabel="training tokens (token passes)", ylabel="τ",
           title="Mean accepted length")
    a1.legend()
    k = max(len(p.get("alpha") or []) for p in pts)
    for j in range(k):
        ys = [(p.get("alpha") or [None] * k)[j] if j < len(p.get("alpha") or []) else None
              for p in pts]
        a2.plot(x, [float("nan") if y is None else y for y in ys], "o-", label=f"α_{j + 1}")
    a2.set(xscale="log", xlabel="training tokens (token passes)", ylabel="acceptance rate",
           ylim=(0, 1), title="Per-position acceptance")
    a2.legend()
    fig.tight_layout()
    tmp = path.with_name("." + path.name)
    fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
    os.replace(tmp, path)
