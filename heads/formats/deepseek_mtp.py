"""A DeepSeek-V3-style MTP layer stitched into a copy of the target checkpoint, for mtp heads.

    OUT/config.json                   the target's config + num_nextn_predict_layers = 1
    OUT/model.safetensors.index.json  the target's weight map + the MTP layer's tensors
    OUT/model-mtp.safetensors         model.layers.{L}.{enorm, hnorm, eh_proj, embed_tokens,
                                      shared_head.norm, shared_head.head, <decoder layer>}
    OUT/<target shards>               symlinks to the target's files (copies with copy=True)

L = the target's num_hidden_layers: the MTP layer follows the last decoder layer, as in
DeepSeek-V3 (vLLM `DeepSeekMTP` reads layer L onward). eh_proj takes [enorm(E(x)); hnorm(h)]
in that order; shared_head.norm is our final_norm. embed_tokens and shared_head.head are the
target's own tensors: DeepSeek checkpoints store a copy per MTP layer and loaders expect it.

Hidden input: our mtp head is trained on the target's PRE-final-norm state h_t (what shards store),
while vLLM/SGLang hand MTP layers the target's post-norm output; the config records
`specheads_mtp.hidden_input` so a serving stack can feed the right one.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from inference_eval.engine.model.arch import ModelArch
from inference_eval.engine.target import frozen_hash, iter_safetensors
from heads.formats.bundle import (HeadBundle, cfg_from_stamp, check_compatible, head_stamp,
                                 read_config, refuse_unused, target_stamp)
from heads.formats.layer_names import layer_from_hf, layer_to_hf

NAME = "deepseek_mtp"
HEAD_TYPES = ("mtp",)
MTP_FILE = "model-mtp.safetensors"
INDEX = "model.safetensors.index.json"
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# MTP-layer tensors outside the decoder layer: ours -> DeepSeek (relative to the layer).
_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "eh_proj.weight", "final_norm.weight": "shared_head.norm.weight"}


def export(bundle: HeadBundle, out: Path, target_dir: Path | None = None,
           copy: bool = False) -> Path:
    """Write OUT as described above; `target_dir` is the target's HF directory."""
    if bundle.cfg.draft_vocab_size is not None:
        raise ValueError(f"{bundle.source}: the head drafts over a reduced vocabulary of "
                         f"{bundle.cfg.draft_vocab_size} tokens, which a DeepSeek MTP layer (it "
                         "shares the target's full lm_head) cannot express; train it with "
                         "head.draft_vocab_size=null to export it, or keep it in the specheads format")
    if target_dir is None:
        raise ValueError(f"format {NAME!r} stitches the head into the target checkpoint: "
                         "pass target_dir (--target-dir), the target's HF directory")
    target_dir = Path(target_dir).resolve()
    if out.resolve() == target_dir:
        raise ValueError(f"output {out} is the target directory; write the stitched copy elsewhere")
    tcfg = read_config(target_dir)
    arch = ModelArch.from_hf_config(tcfg)
    check_compatible(bundle.arch, arch, f"target {target_dir}")
    embed, norm, lm_head = _frozen_tensors(target_dir, arch)
    want = bundle.target.get("frozen_sha256")
    if want and frozen_hash(embed, norm, lm_head) != want:
        raise ValueError(f"{target_dir} is not the target head {bundle.source} was trained for "
                         f"({bundle.target.get('name')!r}): its embedding/norm/lm_head differ")
    prefix = f"model.layers.{arch.num_layers}."
    s = bundle.state
    tensors = {prefix + theirs: s[ours] for ours, theirs in _OWN.items()}
    tensors.update(layer_to_hf(s, "layer.", prefix, bundle.arch))
    tensors[prefix + "embed_tokens.weight"] = embed.to(s["eh_proj.weight"].dtype)
    # A copy even when tied: safetensors refuses two names on one storage.
    tensors[prefix + "shared_head.head.weight"] = lm_head.to(s["eh_proj.weight"].dtype).clone()

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    weight_map, total = _target_weight_map(target_dir)
    for fname in sorted(set(weight_map.values())):
        _place(target_dir / fname, out / fname, copy)
    for f in target_dir.iterdir():  # tokenizer, generation config, chat template ...
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in (
                "config.json", INDEX):
            shutil.copy2(f, out / f.name)
    tmp = out / f".{MTP_FILE}.tmp"
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp),
              metadata={"format": "pt"})
    os.replace(tmp, out / MTP_FILE)
    weight_map.update({k: MTP_FILE for k in tensors})
    total += sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(out / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    config = {**tcfg, "num_nextn_predict_layers": 1,
              "specheads_mtp": {"layer": arch.num_layers, "hidden_input": (
                  "pre-final-norm" if bundle.cfg.hidden_input == "pre_norm" else "post-final-norm")},
              "specheads_target": target_stamp(bundle), "specheads_head": head_stamp(bundle.cfg)}
    _write_json(out / "config.json", config)
    return out


def detect(cfg: dict[str, Any]) -> bool:
    """An MTP layer is declared, or the directory is a DeepSeek checkpoint (read() then says
    that it has no MTP layer, and how to get one)."""
    return "num_hidden_layers" in cfg and (int(cfg.get("num_nextn_predict_layers") or 0) > 0
                                           or cfg.get("model_type") in DEEPSEEK_MODEL_TYPES)


def read(path: Path) -> HeadBundle:
    """A DeepSeek-style directory with its MTP layer at index L (a DeepSeek-V3 checkpoint, or
    what `export` writes) -> bundle of our mtp head. Native layers (no `specheads_mtp` key)
    read the target's post-final-norm state, as vLLM and SGLang feed them; ours the pre-norm
    state they were trained on (HeadConfig.hidden_input)."""
    cfg = read_config(path)
    src = str(path)
    n_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    arch = ModelArch.from_hf_config(cfg)
    L = arch.num_layers
    prefix = f"model.layers.{L}."
    if n_mtp != 1:
        raise ValueError(f"{src}: num_nextn_predict_layers={cfg.get('num_nextn_predict_layers')}"
                         "; our mtp head is one MTP layer (reused for every draft step): "
                         + (_NO_MTP_FIX.format(L=L) if n_mtp == 0 else "use a checkpoint with one"))
    # Only the MTP layer's tensors are read, so a 670B target's shards are opened, not loaded.
    t = {name: get() for name, get in iter_safetensors(path) if name.startswith(prefix)}
    missing = [prefix + theirs for theirs in _OWN.values() if prefix + theirs not in t]
    if missing:
        raise ValueError(f"{src}: config.json says num_nextn_predict_layers=1, but the MTP "
                         f"layer's tensor(s) {missing} are missing (transformers' "
                         "save_pretrained drops layer {L}; so do some hub conversions): "
                         .replace("{L}", str(L)) + _NO_MTP_FIX.format(L=L))
    state = {ours: t.pop(prefix + theirs) for ours, theirs in _OWN.items()}
    state.update(layer_from_hf(t, prefix, "layer.", arch, src))
    moe = "layer.mlp.experts.gate_up_proj" in state  # DeepSeek-V3/R1's own layer routes experts
    embed = t.pop(prefix + "embed_tokens.weight", None)
    head = t.pop(prefix + "shared_head.head.weight", None)
    refuse_unused(t, src, NAME)
    mtp = cfg.get("specheads_mtp") or {}
    hidden_input = "pre_norm" if mtp.get("hidden_input") == "pre-final-norm" else "post_norm"
    target = cfg.get("specheads_target") or {"name": cfg.get("_name_or_path"), "path": src}
    return HeadBundle(cfg_from_stamp(cfg.get("specheads_head"), "mtp", hidden_input=hidden_input,
                                     moe=moe), arch, target, state, src, embed, head)


_NO_MTP_FIX = ("to draft with a native MTP layer, point draft.checkpoint at the original "
               "checkpoint that ships model.layers.{L}.* (e.g. DeepSeek-V3/R1 from the hub); or "
               "train one: python -m train head=mtp ..., then python -m train.export --format "
               "deepseek_mtp --checkpoint <head> --target-dir <this dir> --output <dir>")


def _frozen_tensors(target_dir: Path, arch: ModelArch) -> tuple[torch.Tensor, ...]:
    """embed [V, H], final norm [H], lm_head [V, H] (the embedding when tied)."""
    want = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    got = {name: get() for name, get in iter_safetensors(target_dir) if name in want}
    if arch.tie_word_embeddings or "lm_head.weight" not in got:
        got["lm_head.weight"] = got.get("model.embed_tokens.weight")
    missing = [n for n in sorted(want) if got.get(n) is None]
    if missing:
        raise ValueError(f"target {target_dir} lacks {missing}")
    return got["model.embed_tokens.weight"], got["model.norm.weight"], got["lm_head.weight"]


def _target_weight_map(target_dir: Path) -> tuple[dict[str, str], int]:
    """The target's weight map (name -> shard file) and total byte size."""
    index = target_dir / INDEX
    if index.is_file():
        meta = json.loads(index.read_text())
        files = set(meta["weight_map"].values())
        total = meta.get("metadata", {}).get("total_size") or sum(
            (target_dir / f).stat().st_size for f in files)
        return dict(meta["weight_map"]), int(total)
    from safetensors import safe_open

    weight_map, total = {}, 0
    for f in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                weight_map[name] = f.name
        total += f.stat().st_size
    if not weight_map:
        raise FileNotFoundError(f"no *.safetensors weights in target {target_dir}")
    return weight_map, total


def _place(src: Path, dst: Path, copy: bool) -> None:
    """Symlink (default: a 140 GB target is not duplicated) or copy a target shard."""
    if dst.is_symlink() or dst.exists():
        dst.unlink()
    if copy:
        shutil.copy2(src, dst)
    else:
        dst.symlink_to(src.resolve())


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
