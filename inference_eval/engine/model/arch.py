"""The decoder-only architecture description shared by target and draft models.

One `ModelArch` describes every family we run: the Llama family (Llama 2/3, SmolLM2,
Mistral, Qwen2/2.5, Qwen3) and DeepSeek-V2/V3. Families differ only in flags (qkv bias, q/k
norm, rope scaling, tied embeddings, latent attention, mixture of experts), never in model
code: per-family copies of a model drift apart, one layer fixed once serves them all. The
DeepSeek fields default to "off", so a Llama arch is unchanged.
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
    "DeepseekV2ForCausalLM": (False, False),
    "DeepseekV3ForCausalLM": (False, False),
}
DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# Expert routing: scoring_func -> the topk_method values it supports.
ROUTING = {"softmax": ("greedy", "group_limited_greedy"), "sigmoid": ("noaux_tc",)}


class UnsupportedArchitectureError(ValueError):
    pass


@dataclass
class ModelArch:
    """Sizes and flags of a decoder (Llama family or DeepSeek).

    Shapes in this vocabulary: H = hidden_size, V = vocab_size, heads of width head_dim.

    Multi-head latent attention (MLA) is on when `kv_lora_rank` is set. Its KV cache holds
    one row per token and layer, the normed latent c_kv [kv_lora_rank] and the rotary key
    [qk_rope_head_dim], read as one shared key "head" (values are its first kv_lora_rank
    columns). So for MLA `num_kv_heads` is 1 and `head_dim` is kv_lora_rank +
    qk_rope_head_dim: they describe the cache row, as in vLLM, not the query heads.

    Mixture of experts is on when `n_routed_experts` > 0: layer i is an MoE layer when
    i >= first_k_dense_replace and i % moe_layer_freq == 0, else a dense MLP of
    intermediate_size.
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
    # Multi-head latent attention (DeepSeek); off while kv_lora_rank is None.
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # checkpoint rotates (x0, x1), (x2, x3) pairs
    # Mixture of experts (DeepSeek); off while n_routed_experts is 0.
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"architecture {self.architecture!r} is not supported; supported: "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if self.is_mla:
            self._check_mla()
        if self.n_routed_experts:
            self._check_moe()
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )

    def _check_mla(self) -> None:
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if not getattr(self, key) or getattr(self, key) < 1:
                raise ValueError(f"MLA arch: {key}={getattr(self, key)} must be >= 1")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLA arch: qk_rope_head_dim={self.qk_rope_head_dim} must be even")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"MLA arch: q_lora_rank={self.q_lora_rank} must be None or >= 1")
        # The cache row geometry (see the class docstring); derived, never free.
        self.num_kv_heads, self.head_dim = 1, self.kv_lora_rank + self.qk_rope_head_dim

    def _check_moe(self) -> None:
        if self.scoring_func not in ROUTING:
            raise UnsupportedArchitectureError(
                f"scoring_func={self.scoring_func!r} is not supported; use one of {sorted(ROUTING)}")
        if self.topk_method not in ROUTING[self.scoring_func]:
            raise UnsupportedArchitectureError(
                f"topk_method={self.topk_method!r} is not supported with scoring_func="
                f"{self.scoring_func!r}; use one of {list(ROUTING[self.scoring_func])}")
        e, k = self.n_routed_experts, self.num_experts_per_tok
        if not 1 <= k <= e:
            raise ValueError(f"MoE arch: num_experts_per_tok={k} must be in [1, n_routed_experts={e}]")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"MoE arch: moe_intermediate_size={self.moe_intermediate_size} must be >= 1")
        if self.moe_layer_freq < 1:
            raise ValueError(f"MoE arch: moe_layer_freq={self.moe_layer_freq} must be >= 1")
        if self.topk_method == "group_limited_greedy" and not (self.n_group and self.topk_group):
            raise ValueError("MoE arch: topk_method='group_limited_greedy' needs n_group and topk_group")
        if self.n_group:
            if e % self.n_group:
                raise ValueError(f"MoE arch: n_routed_experts={e} is not a multiple of "
                                 f"n_group={self.n_group}")
            if not self.topk_group or not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"MoE arch: topk_group={self.topk_group} must be in "
                                 f"[1, n_group={self.n_group}]")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def qk_head_dim(self) -> int:
        """Query/key width per head of MLA before absorption: nope + rope parts."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_dim(self) -> int:
        """Width the rotary tables cover: the decoupled rotary key for MLA, else head_dim."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return (self.n_routed_experts > 0 and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

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
                f"{sorted(SUPPORTED_ARCHITECTURES)} (model_type {', '.join(_MODEL_TYPE_TO_ARCH)})"
            )
        if arch in DEEPSEEK_ARCHITECTURES:
            from inference_eval.engine.model.deepseek_config import deepseek_fields

            extra = deepseek_fields(arch, c)
        else:
            extra = {}
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
            **extra,
        )
