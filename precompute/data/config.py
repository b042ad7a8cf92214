"""`DataConfig`: where the chat data comes from and how it is cut, for the `data` Hydra group.

Presets: conf/data/{sharegpt,jsonl,hf}.yaml, and the same three nodes in the ConfigStore via
`register_data_configs`. Every check names its key as `data.<field>`.
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCES = ("sharegpt", "jsonl", "hf", "mix")
# ShareGPT records from here on are held out: validation and the sharegpt_heldout prompts
# read them, the default training slices (limit < 17,000) never reach them.
HELDOUT_SKIP = 17000
_MISSING = "???"  # OmegaConf's mandatory marker; checked again once the value is filled in


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class DataConfig:
    """Chat data for precompute.

    source: "sharegpt" (JSON array; path None = the embedded ShareGPT_V3 file), "jsonl" (path
    required; a JSON-array file is also accepted) or "hf" (`datasets`: hf_name is a hub name
    or a local dataset path, with hf_config and hf_split).
    skip: first N raw records passed over (kept out for a held-out split).
    limit: max conversations kept after validation (None = all).
    max_length: tokens per conversation after the chat template; longer ones are truncated.
    regenerate: train on the target's own answers instead of the assistant turns: precompute
    first runs the self-distillation stage (precompute/distill/) into output_dir/distill,
    answering every user turn (regen_temperature 0 is greedy; regen_max_new_tokens per turn);
    that output is cached, so a resume or rerun never generates again. system_prompt: inserted
    when a conversation has no system turn of its own.
    """

    source: str = "sharegpt"
    path: str | None = None
    hf_name: str | None = None
    hf_split: str = "train"
    hf_config: str | None = None
    limit: int | None = None
    skip: int = 0
    max_length: int = 2048
    regenerate: bool = False
    regen_temperature: float = 0.0
    regen_max_new_tokens: int = 256
    system_prompt: str | None = None
    code_share: float = 0.25

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"data.source must be one of {SOURCES}, got {self.source!r}")
        for key in ("path", "hf_name", "hf_config", "system_prompt"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"data.{key} must be a string or null, got {value!r}")
        if self.source == "mix":
            if self.limit is None or self.path is not None:
                raise ValueError("data=mix (the default self-distillation prompt mix) needs "
                                 "data.limit and reads no data.path")
            if not 0 <= self.code_share <= 1:
                raise ValueError(f"data.code_share must be in [0, 1], got {self.code_share}")
        if self.source == "jsonl" and not self.path:
            raise ValueError("data.path is required with data.source=jsonl (a .jsonl file)")
        if self.source == "hf":
            if not self.hf_name:
                raise ValueError(
                    "data.hf_name is required with data.source=hf: a hub dataset name or the "
                    "path of a local dataset (directory, save_to_disk output or data file)"
                )
            if self.path is not None:
                raise ValueError(
                    "data.path is not read with data.source=hf; put the local dataset path in "
                    "data.hf_name instead"
                )
        if self.source != "hf":
            for key in ("hf_name", "hf_config"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"data.{key} is only read with data.source=hf, but data.source="
                        f"{self.source}; drop it or set data=hf"
                    )
        if not isinstance(self.hf_split, str) or not self.hf_split:
            raise ValueError(f"data.hf_split must be a non-empty string, got {self.hf_split!r}")
        if self.limit is not None and (not _is_int(self.limit) or self.limit < 1):
            raise ValueError(f"data.limit must be a positive integer or null, got {self.limit!r}")
        if not _is_int(self.skip) or self.skip < 0:
            raise ValueError(f"data.skip must be an integer >= 0, got {self.skip!r}")
        if not _is_int(self.max_length) or self.max_length < 2:
            # One token cannot be both context and target.
            raise ValueError(f"data.max_length must be an integer >= 2, got {self.max_length!r}")
        if not isinstance(self.regenerate, bool):
            raise TypeError(f"data.regenerate must be true or false, got {self.regenerate!r}")
        if (
            not isinstance(self.regen_temperature, (int, float))
            or isinstance(self.regen_temperature, bool)
            or self.regen_temperature < 0
        ):
            raise ValueError(
                f"data.regen_temperature must be a number >= 0, got {self.regen_temperature!r}"
            )
        if not _is_int(self.regen_max_new_tokens) or self.regen_max_new_tokens < 1:
            raise ValueError(
                "data.regen_max_new_tokens must be a positive integer, "
                f"got {self.regen_max_new_tokens!r}"
            )


def register_data_configs(cs) -> None:
    """Store the presets in `cs` (a hydra ConfigStore) under group "data"."""
    cs.store(group="data", name="mix", node=DataConfig(source="mix", limit=2000))
    cs.store(group="data", name="sharegpt", node=DataConfig(source="sharegpt"))
    # path is mandatory for jsonl: "???" makes Hydra ask for data.path=FILE.
    cs.store(group="data", name="jsonl", node=DataConfig(source="jsonl", path=_MISSING))
    # hf needs a dataset: "???" makes Hydra ask for data.hf_name=NAME_OR_PATH.
    cs.store(group="data", name="hf", node=DataConfig(source="hf", hf_name=_MISSING))
