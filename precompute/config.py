"""`PrecomputeConfig`: the typed config of `python -m precompute` (conf/precompute.yaml)."""
from __future__ import annotations

from dataclasses import dataclass, field

from heads.config import eagle3_aux_layers
from inference_eval.engine.config import EngineConfig
from inference_eval.engine.target import TargetConfig
from precompute.data import DataConfig

HIDDEN_DTYPES = ("bfloat16", "float16", "float32", "fp8")


@dataclass
class PrecomputeConfig:
    """aux: "none", "eagle3" (outputs of layers 1, L/2-1, L-4, i.e. HF hidden_states[i+1]; the
    inputs of layers 2, L/2, L-3 that vLLM and SpecForge capture) or comma-separated layer ids.
    shard_tokens: tokens per shard file (a shard ends at a sequence boundary).
    batch_tokens: padded tokens per forward pass (sequences are sorted by length first).
    """

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    output_dir: str = "runs/shards"
    hidden_dtype: str = "bfloat16"
    aux: str = "none"
    shard_tokens: int = 262144
    batch_tokens: int = 4096
    dry_run: bool = False
    overwrite: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise ValueError(f"hidden_dtype={self.hidden_dtype!r}: use one of {HIDDEN_DTYPES}")
        for key in ("shard_tokens", "batch_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        self.aux_layer_ids(num_layers=1 << 20)  # syntax check now; range check once L is known

    def aux_layer_ids(self, num_layers: int) -> list[int]:
        return aux_layer_ids(self.aux, num_layers)


def aux_layer_ids(aux: str, num_layers: int, key: str = "aux") -> list[int]:
    """The layer ids of an `aux` setting (none, eagle3 or comma-separated ids)."""
    spec = str(aux).strip().lower()
    if spec in ("none", ""):
        return []
    if spec == "eagle3":
        return eagle3_aux_layers(num_layers)
    try:
        ids = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ValueError(
            f"{key}={aux!r}: use none, eagle3 or comma-separated layer ids") from None
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{key}: aux layer ids {bad} are outside 0..{num_layers - 1}")
    return ids
