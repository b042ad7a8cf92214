"""`DistillConfig`: the typed config of `python -m precompute.distill` (conf/distill.yaml)."""
from __future__ import annotations

from dataclasses import dataclass, field

from inference_eval.engine.config import EngineConfig
from inference_eval.engine.sampling import SamplingParams
from inference_eval.engine.target import TargetConfig
from precompute.data import DataConfig

TURNS = ("first", "all")
# Prompts per engine call. Measured on 2 shared CPU cores, SmolLM2-135M fp32, ShareGPT first
# turns under 600 characters, greedy: 32 prompts x 32 new tokens ran at 12 / 26 / 51 / 64
# tok/s with batches of 1 / 4 / 16 / 32; 64 prompts x 64 tokens at 70 / 80 / 93 tok/s with
# 16 / 32 / 64. Bigger batches keep gaining, but the default 0.5 GB KV cache (46 KB a SmolLM2
# token in fp32, ~11.6k tokens) holds 16 requests of a ~200-token prompt plus a 512-token
# answer; past that the engine preempts and recomputes. 16 also bounds what a kill loses.
CPU_BATCH_SIZE = 16


def _default_engine() -> EngineConfig:
    return EngineConfig(max_batch_size=CPU_BATCH_SIZE)


def _default_sampling() -> SamplingParams:
    # Greedy, like greedy evaluation: the head learns the answers it will draft against.
    return SamplingParams(temperature=0.0, max_new_tokens=512)


@dataclass
class DistillConfig:
    """The target answers prompts itself; the answers become training conversations.

    data: where the prompts come from (the `data` group; assistant turns are ignored, and
    `{"prompt": ...}` records are accepted). data.system_prompt, when set, is the system turn
    of every prompt that has none (and is written into the conversations).
    turns: "first" answers the first user turn only; "all" answers every user turn in order,
    each conditioned on the target's own earlier answers.
    sampling: temperature 0 (default) is greedy; max_new_tokens caps each answer, and an
    answer cut there is written with `truncated: true`.
    engine.max_batch_size: prompts per engine call (one batch, one fsync of the output).
    shards_dir: also write training shards there, in the same pass: the hidden states the
    engine computed while generating (precompute/capture.py), no second prefill over prompt +
    answer. hidden_dtype, aux, shard_tokens: as precompute's keys; records are cut at
    data.max_length. None (default) writes conversations only.
    """

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    engine: EngineConfig = field(default_factory=_default_engine)
    sampling: SamplingParams = field(default_factory=_default_sampling)
    output_dir: str = "runs/distill"
    turns: str = "first"
    overwrite: bool = False
    progress: bool = True
    shards_dir: str | None = None
    hidden_dtype: str = "bfloat16"
    aux: str = "none"
    shard_tokens: int = 262144

    def __post_init__(self) -> None:
        from precompute.config import HIDDEN_DTYPES, aux_layer_ids

        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise ValueError(f"hidden_dtype={self.hidden_dtype!r}: use one of {HIDDEN_DTYPES}")
        if self.shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1, got {self.shard_tokens}")
        aux_layer_ids(self.aux, num_layers=1 << 20)  # syntax now; range once L is known
        if self.turns not in TURNS:
            raise ValueError(f"turns={self.turns!r}: use one of {TURNS}")
        if not isinstance(self.output_dir, str) or not self.output_dir:
            raise ValueError(f"output_dir must be a non-empty path, got {self.output_dir!r}")
        if self.data.regenerate:
            raise ValueError("data.regenerate is a precompute key (it runs this stage); the "
                             "distill stage always generates: drop data.regenerate=true")
