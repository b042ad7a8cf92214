"""Metrics to the console (via the progress bar), a JSONL file, wandb and TensorBoard."""
from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path


class MetricLogger:
    def __init__(self, cfg, out: Path, enabled: bool = True) -> None:
        self.enabled, self.history = enabled, []
        self.wandb = self.tb = None
        if not enabled:
            return
        out.mkdir(parents=True, exist_ok=True)
        self.file = open(out / "metrics.jsonl", "a")
        tc = cfg.trainer
        if tc.wandb != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.wandb = wandb.init(project=tc.wandb_project, mode=tc.wandb, dir=str(out),
                                    config=json.loads(json.dumps(asdict(cfg), default=str)))
        if tc.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"))

    def log(self, metrics: dict) -> None:
        if not self.enabled:
            return
        self.history.append(metrics)
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        flat = {}  # scalars only: None (e.g. a draft position never attempted) is left out
        for k, v in metrics.items():
            if isinstance(v, list):
                flat.update({f"{k}/step{i + 1}": x for i, x in enumerate(v)
                             if isinstance(x, (int, float))})
            elif isinstance(v, (int, float)):
                flat[k] = v
        if self.wandb is not None:
            self.wandb.log(flat, step=int(metrics.get("step", 0)))
        if self.tb is not None:
            for k, v in flat.items():
                self.tb.add_scalar(k, v, int(metrics.get("step", 0)))

    def close(self) -> None:
        if not self.enabled:
            return
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tb is not None:
            self.tb.close()
