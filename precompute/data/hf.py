"""Load chats from a `datasets` dataset: a hub name or a local path, rows with a
`conversations` (ShareGPT) or `messages` (OpenAI) column, validated like the file loaders.

`name` resolution: an existing directory written by `save_to_disk` goes through
`load_from_disk`; an existing .json/.jsonl/.parquet/.csv/.arrow file through the matching
builder; anything else (a hub name, a dataset directory of data files) through
`load_dataset(name, config, split=split)`.
"""

from __future__ import annotations

from pathlib import Path

from .records import LoadReport, LoadResult
from .validate import collect

CHAT_COLUMNS = ("conversations", "messages")
PROMPT_COLUMN = "prompt"
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv",
             ".arrow": "arrow"}
_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def _open_dataset(name: str, config: str | None, split: str):
    """A `datasets.Dataset` for (name, config, split); errors name all three."""
    import datasets  # heavy import, only for source=hf

    local = Path(name).expanduser()
    where = f"dataset {name!r} (config {config!r}, split {split!r})"
    try:
        if local.is_dir() and any((local / m).is_file() for m in _SAVED_MARKERS):
            ds = datasets.load_from_disk(str(local))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise KeyError(f"split {split!r} not in saved splits {sorted(ds)}")
                ds = ds[split]
            return ds
        if local.is_file():
            builder = _BUILDERS.get(local.suffix.lower())
            if builder is None:
                raise ValueError(
                    f"unknown data file type {local.suffix!r}; use one of {sorted(_BUILDERS)}"
                )
            return datasets.load_dataset(builder, data_files={split: str(local)}, split=split)
        return datasets.load_dataset(name, config, split=split)
    except Exception as e:  # datasets raises many types; add which dataset it was
        raise ValueError(
            f"could not load {where}: {type(e).__name__}: {e}. Check data.hf_name, "
            "data.hf_config and data.hf_split."
        ) from e


def load_hf(
    name: str,
    *,
    config: str | None = None,
    split: str = "train",
    skip: int = 0,
    limit: int | None = None,
    prompts: bool = False,
) -> LoadResult:
    """Load, validate and report one split of a `datasets` dataset.

    Row index (0-based) stands in for a missing "id" column: ids become "{name}[{split}]:{i}".
    prompts: read prompt records (a "prompt" string column is accepted too).
    Raises ValueError if the split has no chat column at all (every row would be rejected).
    """
    ds = _open_dataset(name, config, split)
    columns = list(ds.column_names)
    wanted = CHAT_COLUMNS + (PROMPT_COLUMN,) if prompts else CHAT_COLUMNS
    if not any(c in columns for c in wanted):
        raise ValueError(
            f"dataset {name!r} split {split!r} has columns {columns}; it needs one of "
            f"{wanted} holding a list of turns" + (" or a prompt string" if prompts else "")
        )
    source_name = f"{Path(name).name if Path(name).exists() else name}[{split}]"
    report = LoadReport(source=f"hf:{name}" + (f":{config}" if config else "") + f"[{split}]")
    return collect(enumerate(ds), source_name=source_name, report=report, skip=skip, limit=limit,
                   prompts=prompts)
