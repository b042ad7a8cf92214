"""`HeadBundle`: a draft head between file formats (its config, the layer's shapes, the target
it belongs to and its trainable tensors in OUR names), plus the file-level helpers every
format shares: reading a config and safetensors, writing a directory, the Llama layer config,
the export stamps, the shape checks.

Exporters read a bundle straight from a checkpoint without building the target (a 70B
target costs nothing to export a head for); importers produce a bundle from a foreign
directory, and heads.formats.specheads.to_head puts it on the target's frozen parts. This
module builds no head: it sits below every format module, ours included.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from heads.config import HeadConfig
from inference_eval.engine.model.arch import ModelArch

# Layer shapes a head must share with its target: our head's layer is built from the target's
# ModelArch, so a foreign head with other sizes cannot be expressed.
_SHAPE_FIELDS = ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "rms_norm_eps", "qkv_bias", "qk_norm")


@dataclass
class HeadBundle:
    """cfg: our HeadConfig (aux_layers empty = the engines' EAGLE-3 default, resolved on the
    target). arch: layer shapes and rope of the head (the target's for our checkpoints).
    target: identity of the target it was trained for ({} when a foreign file names none).
    state: trainable tensors by our parameter names, e.g. layer.self_attn.qkv_proj.weight.
    embed / lm_head: a foreign checkpoint's copies of the target's embedding and lm_head [V, H]
    (DeepSeek MTP layers carry both), or None; they must equal the target's."""

    cfg: HeadConfig
    arch: ModelArch
    target: dict[str, Any]
    state: dict[str, torch.Tensor]
    source: str
    embed: torch.Tensor | None = None
    lm_head: torch.Tensor | None = None


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a foreign head directory (single or sharded safetensors; never pickle)."""
    from inference_eval.engine.target import iter_safetensors

    if not any(path.glob("*.safetensors")):
        bins = sorted(p.name for p in path.glob("*.bin"))
        raise FileNotFoundError(
            f"{path}: no *.safetensors weights" + (f" (found {bins}; pickled weights are not "
            "loaded: convert them with safetensors.torch.save_file first)" if bins else ""))
    return {name: get() for name, get in iter_safetensors(path)}


def read_config(path: Path) -> dict[str, Any]:
    p = path / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"no draft head at {path} (config.json missing)")
    return read_json(p)


# A file cut short by a crash or a full disk: the fix is the same for every checkpoint file.
_DAMAGED = ("the file is damaged (cut short by a crash or a full disk?): save or export the "
            "head again, or for a training checkpoint delete that checkpoint directory to "
            "resume from the one before")


def read_json(p: Path) -> Any:
    """A checkpoint's JSON file; a ValueError naming it when it does not parse."""
    try:
        return json.loads(Path(p).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{p} is not valid JSON ({exc}): {_DAMAGED}") from exc


def read_safetensors(p: Path) -> dict[str, torch.Tensor]:
    """One safetensors file (never pickle); a ValueError naming it when it does not load."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(p))
    except SafetensorError as exc:
        raise ValueError(f"{p} is not a readable safetensors file ({exc}): {_DAMAGED}") from exc


def read_one_layer_config(path: Path, head: str) -> dict[str, Any]:
    """config.json of an EAGLE-style draft checkpoint, which must hold exactly one layer."""
    cfg = read_config(path)
    if cfg.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{path}: {cfg['num_hidden_layers']} draft layers; our {head} head "
                         "has one")
    return cfg


def refuse_sliding_window(layer_cfg: dict[str, Any], source: str, head: str) -> None:
    """Our draft layers attend over the whole context: a config with sliding-window layers
    describes another model."""
    if any(t == "sliding_attention" for t in layer_cfg.get("layer_types") or []):
        raise ValueError(f"{source}: sliding-window draft layers; our {head} layers attend fully")


def has_architecture(cfg: dict[str, Any], names: tuple[str, ...] | set[str]) -> bool:
    return any(a in names for a in cfg.get("architectures") or [])


def write_dir(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
              weights_name: str = "model.safetensors") -> Path:
    """config.json + one safetensors file, each written to a temp name and renamed."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{weights_name}.tmp"
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp),
              metadata={"format": "pt"})
    os.replace(tmp, out / weights_name)
    ctmp = out / ".config.json.tmp"
    ctmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(ctmp, out / "config.json")
    return out


def target_stamp(bundle: HeadBundle) -> dict[str, Any]:
    """What an exported config records about the target (engines ignore the extra key)."""
    t, a = bundle.target, bundle.arch
    return {"name": t.get("name"), "source": t.get("source"), "path": t.get("path"),
            "weights_sha256": t.get("weights_sha256"), "frozen_sha256": t.get("frozen_sha256"),
            "architecture": a.architecture, "hidden_size": a.hidden_size,
            "vocab_size": a.vocab_size, "num_layers": (t.get("arch") or {}).get("num_layers")}


def stamps(bundle: HeadBundle, verifier: Any) -> dict[str, Any]:
    """The config keys every export carries: which target (and verifier) and which head."""
    return {"specheads_target": {**target_stamp(bundle), "verifier": verifier},
            "specheads_head": head_stamp(bundle.cfg)}


def head_stamp(cfg: HeadConfig) -> dict[str, Any]:
    """Our head config, so an export -> import round trip restores the training settings."""
    return asdict(cfg)


def cfg_from_stamp(stamp: dict[str, Any] | None, kind: str, **truth: Any) -> HeadConfig:
    """HeadConfig from an exported `specheads_head` (if it is for the same head type), with
    the fields the format itself states (`truth`) taking precedence."""
    base = dict(stamp) if stamp and stamp.get("type") == kind else {"type": kind}
    return HeadConfig.from_dict({**base, **truth})


def llama_layer_config(arch: ModelArch, **extra: Any) -> dict[str, Any]:
    """HF LlamaConfig fields of a draft layer with the target's shapes and rope (one layer
    unless `extra` sets num_hidden_layers).

    rope_theta/rope_scaling are the keys vLLM, SGLang and EAGLE read; transformers >= 5
    converts them to rope_parameters itself. A DeepSeek head's layer (latent attention) has
    no Llama form: it is refused, and exports to deepseek_mtp instead."""
    if arch.is_mla:
        raise ValueError("the head's layer uses DeepSeek's multi-head latent attention, which "
                         "an EAGLE/speculators (Llama-layer) config cannot express; export an mtp "
                         "head on a DeepSeek target to format 'deepseek_mtp'")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size,
            "intermediate_size": arch.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads,
            "head_dim": arch.head_dim, "hidden_act": "silu", "rms_norm_eps": arch.rms_norm_eps,
            "rope_theta": arch.rope_theta, "rope_scaling": arch.rope_scaling,
            "max_position_embeddings": arch.max_position_embeddings,
            "attention_bias": False, "mlp_bias": False,
            "tie_word_embeddings": arch.tie_word_embeddings, "bos_token_id": arch.bos_token_id,
            "eos_token_id": arch.eos_token_ids[0] if arch.eos_token_ids else None,
            **extra}


def dtype_name(tensors: dict[str, torch.Tensor]) -> str:
    """The floating dtype of a head's weights, as HF configs spell it ("bfloat16")."""
    t = next(v for v in tensors.values() if v.is_floating_point())
    return str(t.dtype).removeprefix("torch.")


def arch_from_config(cfg: dict[str, Any], source: str) -> ModelArch:
    """A foreign layer config (HF style) -> ModelArch; the architecture name is irrelevant to a
    one-layer draft, so anything that is not a known family reads as Llama."""
    c = dict(cfg)
    c.setdefault("num_hidden_layers", 1)
    if c.get("model_type") not in ("llama", "mistral", "qwen2", "qwen3"):
        c["model_type"], c["architectures"] = "llama", []
    try:
        return ModelArch.from_hf_config(c)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{source}: config.json lacks layer field {exc}") from None


def refuse_unused(tensors: dict[str, torch.Tensor], source: str, fmt: str) -> None:
    """Whatever an importer did not consume is a part our head cannot express."""
    if tensors:
        names = sorted(tensors)
        raise ValueError(f"{source}: tensors {names[:6]}{' ...' if len(names) > 6 else ''} "
                         f"have no place in our head; this {fmt} checkpoint is a variant the "
                         "importer does not support")


def check_compatible(arch: ModelArch, target: ModelArch, source: str,
                     ignore: tuple[str, ...] = ()) -> None:
    """ignore: fields the head sets itself (a dflash head's layers always have q/k norms)."""
    for f in _SHAPE_FIELDS:
        if f in ignore:
            continue
        mine, theirs = getattr(arch, f), getattr(target, f)
        if mine != theirs:
            raise ValueError(f"{source}: the head has {f}={mine}, but the target has "
                             f"{f}={theirs}; a head only loads onto the target it was trained for")
