"""`python -m train.export`: convert a head checkpoint to a serving format, or import one.

    python -m train.export --checkpoint runs/head --format speculators --output runs/head_vllm
    python -m train.export --checkpoint runs/head --format eagle3 --output runs/head_sglang
    python -m train.export --checkpoint runs/head --format deepseek_mtp \\
                           --target-dir /models/llama --output runs/llama_with_mtp
    python -m train.export --checkpoint runs/head_vllm --format specheads \\
                           --target-dir /models/llama --output runs/head_back   # import
    python -m train.export --checkpoint sglang_eagle3_dir --format speculators --output vllm_dir

Prints one JSON line: {"export": FORMAT, "checkpoint": ..., "output": ..., "files": [...]}.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from heads.formats.registry import FORMATS, detect_format, export_head, import_head
from inference_eval.hydra_app import user_errors

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True, type=Path,
                   help="head directory: ours, or any format listed (converts between them)")
    p.add_argument("--format", required=True, choices=[*FORMATS, "specheads"],
                   help="format to write; 'specheads' imports a foreign head into ours")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--target-dir", default=None,
                   help="the target: HF directory (or .gguf / pkg: spec when importing); needed "
                        "by deepseek_mtp and by imports")
    p.add_argument("--verifier", default=None,
                   help="name/path engines load as the target (default: the checkpoint's target)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="dtype of the exported weights (default: the checkpoint's)")
    p.add_argument("--copy", action="store_true",
                   help="deepseek_mtp: copy the target's shards instead of symlinking them")
    return p.parse_args(argv)


def import_to_specheads(src: Path, target: str, out: Path) -> Path:
    """A foreign head -> our checkpoint format, on the frozen parts of `target`."""
    from heads.checkpoint import save_head
    from heads.frozen import load_frozen
    from inference_eval.engine.target import TargetConfig

    fmt = detect_format(src)
    gguf = target.endswith(".gguf")
    name = Path(target.rstrip("/")).stem if gguf else Path(target.rstrip("/")).name
    parts = load_frozen(TargetConfig(name=name, source="gguf" if gguf else "hf", path=target))
    head = import_head(src, parts, fmt)
    return save_head(head, out, extra={"imported_from": {"format": fmt, "path": str(src)}})


def main(argv: list[str] | None = None) -> int:
    """Bad input (a missing or foreign checkpoint, a format that cannot hold the head) ends
    as one `error: ...` line and exit 2 (inference_eval/hydra_app.py: the CLI boundary)."""
    a = parse(argv)
    with user_errors():
        if a.format == "specheads":
            if a.target_dir is None:
                raise ValueError("importing needs --target-dir: the target the head drafts for")
            out = import_to_specheads(a.checkpoint, a.target_dir, a.output)
        else:
            out = export_head(a.checkpoint, a.format, a.output, verifier=a.verifier,
                              target_dir=a.target_dir, copy=a.copy,
                              dtype=_DTYPES[a.dtype] if a.dtype else None)
    print(json.dumps({"export": a.format, "checkpoint": str(a.checkpoint), "output": str(out),
                      "files": sorted(p.name for p in out.iterdir())}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
