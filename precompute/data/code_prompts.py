"""Programming prompts built from the documentation that ships with Python itself.

A small chat model is asked for code a good part of the time, and the headline evaluation
(HumanEval) is code, but ShareGPT is mostly chat. This source turns the public functions of
standard-library modules into requests such as "Write a Python function `chunked(items, n)`
that ...", from their signatures and the first sentence of their docstrings. It is installed
with every Python (no download) and is no evaluation set: functions named like a HumanEval
problem (`median`, `add`, ...) are left out (precompute/data/decontaminate.py).

Each prompt is a prompt-only record (a single user turn); the target answers it in the
self-distillation stage, so the code the head learns from is the target's own.
"""
from __future__ import annotations

import importlib
import inspect
import random
import re

from .decontaminate import humaneval_entry_points

# Modules whose public functions are small, self-contained tasks (pure functions on strings,
# numbers, sequences, dates, paths), the kind of request a chat model gets.
MODULES = (
    "bisect", "heapq", "itertools", "functools", "operator", "statistics", "math", "cmath",
    "fractions", "decimal", "random", "string", "textwrap", "difflib", "re", "shlex", "fnmatch",
    "glob", "posixpath", "json", "csv", "base64", "binascii", "hashlib", "zlib", "html",
    "urllib.parse", "ipaddress", "calendar", "datetime", "colorsys", "copy", "pprint", "keyword",
    "unicodedata", "quopri", "uu", "shutil", "tempfile", "secrets", "uuid", "email.utils",
    "wave", "array", "collections", "dataclasses", "enum", "types", "typing", "contextlib",
    "inspect", "ast", "tokenize", "zipfile", "tarfile", "gzip", "sqlite3", "gettext", "locale",
)

TEMPLATES = (
    "Write a Python function `{sig}` that {doc}",
    "Implement `{sig}` in Python without using the `{mod}` module. It {doc}",
    "In Python, how would I write a function `{sig}`? It should {doc_inf}",
    "Write a Python function `{sig}`: {doc_cap} Include a short docstring and an example.",
    "Explain what `{mod}.{name}` does in Python and show a small example of using it.",
    "Write a function in Python that {doc} Call it `{name}`.",
    "Write unit tests with pytest for a function `{sig}` that {doc}",
    "Rewrite `{mod}.{name}` as a plain Python function `{sig}` and explain how it works.",
)


def _first_sentence(doc: str) -> str | None:
    text = " ".join(doc.strip().split())
    m = re.match(r"(.{12,240}?[.!?])(\s|$)", text)
    if not m:
        return None
    s = m.group(1)
    if s.lower().startswith(("deprecated", "internal", "helper", "undocumented", "see ")):
        return None
    return s


def _signature(name: str, obj) -> str | None:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return None
    if len(sig) > 80 or "<" in sig:  # defaults that print as object reprs
        return None
    return f"{name}{sig}"


def documented_functions() -> list[tuple[str, str, str, str]]:
    """(module, name, signature, first docstring sentence) for each usable public function,
    in a fixed order (module list, then name), so the prompt set is reproducible."""
    out = []
    for mod_name in MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:  # e.g. a module a Python build leaves out
            continue
        for name in sorted(getattr(mod, "__all__", None) or dir(mod)):
            if name.startswith("_"):
                continue
            obj = getattr(mod, name, None)
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj)) or not obj.__doc__:
                continue
            if name in humaneval_entry_points():  # e.g. statistics.median vs HumanEval/47
                continue
            sig, doc = _signature(name, obj), _first_sentence(obj.__doc__)
            if sig and doc:
                out.append((mod_name, name, sig, doc))
    return out


def _third_person(doc: str) -> str:
    """'Return the sum.' -> 'returns the sum.' (docstrings are imperative)."""
    first, _, rest = doc.partition(" ")
    verb = first.lower()
    if verb.endswith(("s", "sh", "ch", "x")):
        verb += "es"
    elif verb.endswith("y") and len(verb) > 2 and verb[-2] not in "aeiou":
        verb = verb[:-1] + "ies"
    else:
        verb += "s"
    return f"{verb} {rest}".strip()


def code_prompts(limit: int | None = None, seed: int = 0) -> list[dict]:
    """Prompt-only records {"id", "category": "code", "source", "messages"}: one template per
    function, chosen by a seeded generator, shuffled with the same seed."""
    rng = random.Random(seed)
    records = []
    for mod, name, sig, doc in documented_functions():
        template = rng.choice(TEMPLATES)
        text = template.format(sig=sig, mod=mod, name=name, doc=_third_person(doc),
                               doc_cap=doc, doc_inf=doc[0].lower() + doc[1:])
        records.append({"id": f"stdlib:{mod}.{name}", "category": "code",
                        "source": "python-stdlib-docs",
                        "messages": [{"role": "user", "content": text}]})
    rng.shuffle(records)
    return records[:limit] if limit is not None else records
