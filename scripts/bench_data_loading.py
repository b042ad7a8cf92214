"""Chat-data loading speed: `load_sharegpt` vs the standard library parsing the same elements.

    .venv/bin/python scripts/bench_data_loading.py [--path FILE] [--reps 3]

- ours: precompute.data.load_sharegpt (the embedded ShareGPT_V3 file unless --path): read,
  parse element by element with JSONDecoder.raw_decode (so a cut-off last element is dropped
  and measured), validate and normalise every conversation, count rejections.
- base: the least any loader of this file pays: read and decode it, then one `json.loads` of
  the same complete elements (the text up to the cut ours found, closed with `]`), no
  validation.
The two alternate --reps times (ours first on even reps, base first on odd ones), so load from
other users of a shared machine falls on both alike; each side's best time is reported.
Ends with one JSON line: {"bench": "data_loading", "ours_s", "base_s", "ratio" (ours / base),
"records", "kept", "file_mb", "reps"}.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from precompute.data import load_sharegpt
from precompute.data.sharegpt import embedded_sharegpt_path


def ours(path: Path):
    t = time.perf_counter()
    result = load_sharegpt(path)
    return time.perf_counter() - t, result


def base(path: Path, tail_chars: int) -> tuple[float, int]:
    """Seconds and elements of one json.loads over the complete elements of `path`."""
    t = time.perf_counter()
    text = path.read_bytes().decode("utf-8", errors="ignore").removeprefix("\ufeff")
    if tail_chars:  # cut inside the last element: close the array after the one before it
        text = text[:len(text) - tail_chars].rstrip().removesuffix(",") + "]"
    records = json.loads(text, strict=False)
    return time.perf_counter() - t, len(records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", type=Path, default=None, help="a JSON-array chat file (default: "
                    "the embedded ShareGPT_V3 file)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    path = args.path or embedded_sharegpt_path()
    _, first = ours(path)  # warm-up: page cache, and where the cut is
    report = first.report
    tail = report.tail_chars_dropped
    secs = {"ours": [], "base": []}
    elements = None
    for rep in range(args.reps):
        for side in ("ours", "base") if rep % 2 == 0 else ("base", "ours"):
            if side == "ours":
                s, _ = ours(path)
            else:
                s, elements = base(path, tail)
            secs[side].append(s)
            print(f"rep {rep + 1}/{args.reps} {side}: {s:.2f} s", flush=True)
    if elements != report.records_seen:
        raise SystemExit(f"base parsed {elements} elements, ours saw {report.records_seen}: "
                         "the two sides did not read the same records")
    best = {k: min(v) for k, v in secs.items()}
    ratio = best["ours"] / best["base"]
    mb = path.stat().st_size / 1e6
    print(f"{report.records_seen} records ({report.kept} kept) in {mb:.0f} MB: ours "
          f"{best['ours']:.2f} s, json.loads {best['base']:.2f} s: {ratio:.2f}x", flush=True)
    print(json.dumps({"bench": "data_loading", "ours_s": round(best["ours"], 3),
                      "base_s": round(best["base"], 3), "ratio": round(ratio, 2),
                      "records": report.records_seen, "kept": report.kept,
                      "file_mb": round(mb, 1), "reps": args.reps}))


if __name__ == "__main__":
    main()
