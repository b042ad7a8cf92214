"""The decoder-only architecture description shared by target and draft models.

One `ModelArch` describes every member of the Llama family we run (Llama 2/3, SmolLM2,
Mistral, Qwen2/2.5, Qwen3); families differ only in flags (qkv bias, q/k norm, rope
scaling, tied embeddings), never in model code (STYLE 7).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# HF architecture name -> (qkv_bias, qk_norm). Anything else is refused by name.
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class UnsupportedArchitectureError(ValueError):
    pass


@dataclass
class ModelArch:
    """Sizes and flags of a Llama-family decoder.

    Shapes in this vocabulary: H = hidden_size, V = vocab_size, heads of width head_dim.
    """

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"architecture {self.architecture!r} is not supported; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelArch":
        """Build from a transformers `PretrainedConfig` (or its dict); refuses unknown families."""
        c = cfg if isinstance(cfg, dict) else cfg.to_dict()
        archs = c.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            arch = _MODEL_TYPE_TO_ARCH.get(c.get("model_type", ""))
        if arch is None:
            raise UnsupportedArchitectureError(
                f"architecture {archs or c.get('model_type')!r} is not supported; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)} (model_type llama, mistral, qwen2, qwen3)"
            )
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        # transformers >= 5 moves rope_theta/rope_scaling into `rope_parameters`.
        rope_params = c.get("rope_parameters") or {}
        rope_theta = c.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        scaling = c.get("rope_scaling") or None
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        eos = c.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=c.get("max_position_embeddings", 2048),
            qkv_bias=bool(c.get("attention_bias", qkv_bias)) or qkv_bias,
            qk_norm=qk_norm,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
