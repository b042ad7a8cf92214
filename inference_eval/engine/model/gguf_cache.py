"""Turn a GGUF file into a Hugging Face style directory once, then load that.

Dequantizing GGUF and parsing its tokenizer takes ~25 s on a laptop CPU; the converted
directory (config.json, model.safetensors, tokenizer files) loads in about a second. The
directory is keyed by the GGUF's sha256 and written under a temp name, then renamed, so an
interrupted conversion never leaves a half-written target behind.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch


def file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def default_cache_root() -> Path:
    return Path(os.environ.get("SPECHEADS_CACHE", Path.home() / ".cache" / "specheads"))


def materialize_gguf(gguf_path: str | Path, cache_root: str | Path | None = None) -> Path:
    """Return an HF directory with the GGUF's config, fp32 weights and tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF target file not found: {gguf_path}")
    digest = file_sha256(gguf_path)
    root = Path(cache_root) if cache_root else default_cache_root()
    out = root / f"{gguf_path.stem}-{digest[:16]}"
    if (out / "specheads_source.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=root))
    try:
        src_dir, name = str(gguf_path.parent), gguf_path.name
        config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
        tensors = {k: v.contiguous() for k, v in parsed["tensors"].items()}
        save_file(tensors, str(tmp / "model.safetensors"))
        config.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(src_dir, gguf_file=name).save_pretrained(tmp)
        (tmp / "specheads_source.json").write_text(
            json.dumps({"gguf": str(gguf_path), "sha256": digest}, indent=1))
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished first; keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
