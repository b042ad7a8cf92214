"""Which rows or columns of every weight a tensor-parallel rank holds.

Megatron's split (and vLLM's KV rule) over T ranks, seen from rank r; nh query heads and nkv
key/value heads of width d, hidden size H, intermediate size I, vocabulary V, Vp = ceil(V/T):

| weight | split | rank r holds |
|---|---|---|
| qkv_proj [(nh + 2 nkv) d, H] (+ bias) | rows | query heads r*nh/T.., their k, v heads |
| o_proj [H, nh d] | columns (then all-reduce) | the columns of its query heads |
| gate_up_proj [2 I, H] | rows | gate rows r*I/T.. and the same up rows |
| down_proj [H, I] | columns (then all-reduce) | the same I/T columns |
| embed_tokens, lm_head [V, H] | rows (vocabulary-parallel) | rows r*Vp.., zero-padded |
| norms (q/k norms too) | replicated | everything |

KV heads: T divides nkv -> nkv/T heads each; nkv divides T -> one head each, replicated on
T/nkv ranks (query head j reads kv head j // (nh/nkv), and rank r's nh/T query heads all
fall in kv head r*nkv // T). Anything else is refused by name.

DeepSeek (multi-head latent attention, n = qk_nope, p = qk_rope, v = v_head, r = kv_lora,
q = q_lora rank; E routed experts of Im, shared experts of Is = n_shared * Im):

| weight | split | rank r holds |
|---|---|---|
| qkv_a_proj [q + r + p, H] (q_a_proj; kv_a_proj_with_mqa) | rows | all of it: the q latent and the KV latent are per token, not per head |
| qkv_a_proj [nh (n + p) + r + p, H] (no q low rank: q_proj; kv_a) | rows | its heads' q rows, all r + p latent rows |
| q_b_proj [nh (n + p), q] | rows | its heads' rows |
| kv_b_proj [nh (n + v), r] | rows | its heads' W_uk, W_uv rows |
| o_proj [H, nh v] | columns (then all-reduce) | its heads' columns |
| mlp.gate (router) [E, H], e_score_correction_bias [E] | replicated | everything |
| experts.gate_up_proj [E, 2 Im, H] | TP: dim 1; EP: dim 0 | TP: gate rows r*Im/T.. and the same up rows of every expert; EP: experts r*E/T.. whole |
| experts.down_proj [E, H, Im] | TP: dim 2; EP: dim 0 | the same Im/T columns of every expert; EP: the same whole experts |
| shared_experts gate_up / down | as a dense MLP of Is (TP and EP) | Is/T rows / columns |

The MoE's one all-reduce sums the routed and the shared partial outputs (tp.py); a dense
first layer is a plain MLP (one all-reduce after down_proj).

A spec is the global index (along its dim) of every local row or column, -1 for padding; the
loader reads those slices (loading.py) and the fingerprint samples them (fingerprint.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from inference_eval.engine.model.arch import ModelArch


@dataclass(frozen=True)
class ShardSpec:
    """dim: 0 (rows), 1 (columns), 2 (an expert's columns) or None (replicated);
    index [local] global ids along dim, -1 = pad."""

    dim: int | None
    index: torch.Tensor | None = None

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full tensor (padding rows zero)."""
        if self.dim is None:
            return full.clone()
        safe = self.index.clamp(min=0)
        out = full.index_select(self.dim, safe.to(full.device))
        mask_shape = [1] * full.dim()
        mask_shape[self.dim] = -1
        return out * (self.index >= 0).view(mask_shape).to(out.device, out.dtype)


REPLICATED = ShardSpec(None)


def _rows(starts_stops: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in starts_stops])


class ShardPlan:
    """The split of one ModelArch over `size` ranks, seen from `rank`. expert_parallel: a
    DeepSeek target's routed experts are split whole over the ranks (E/T each) instead of
    each expert's intermediate dimension."""

    def __init__(self, arch: ModelArch, size: int, rank: int,
                 expert_parallel: bool = False) -> None:
        check_arch(arch, size, expert_parallel)
        self.arch, self.size, self.rank = arch, size, rank
        self.expert_parallel = expert_parallel
        h, kv, t = arch.num_heads, arch.num_kv_heads, size
        self.heads = h // t
        self.kv_heads = kv // t if kv % t == 0 else 1
        self.head_start = rank * self.heads
        self.kv_start = rank * self.kv_heads if kv % t == 0 else rank * kv // t
        self.inter = arch.intermediate_size // t
        self.vocab_per_rank = -(-arch.vocab_size // t)
        self.vocab_start = rank * self.vocab_per_rank
        # Mixture of experts: every expert's intermediate split (TP) or whole experts (EP);
        # the shared experts split like a dense MLP either way.
        e, im = arch.n_routed_experts, arch.moe_intermediate_size
        self.experts = e // t if expert_parallel else e
        self.expert_start = rank * self.experts if expert_parallel else 0
        self.moe_inter = im if expert_parallel else im // t
        self.shared_inter = arch.n_shared_experts * im // t

    def local_arch(self) -> ModelArch:
        """The arch of one rank's attention and cache (heads, KV heads, intermediate size
        local; vocabulary and hidden size global: logits are gathered before sampling). Under
        MLA the cache row (num_kv_heads 1, head_dim r + p) stays the leader's: every rank
        caches the whole latent. MoE sizes stay global (every rank routes over all experts)."""
        d = self.arch.to_dict()
        d.update(num_heads=self.heads, num_kv_heads=self.kv_heads, intermediate_size=self.inter)
        return ModelArch(**d)

    def qkv_rows(self) -> torch.Tensor:
        a, d = self.arch, self.arch.head_dim
        q0, k0, v0 = 0, a.q_size, a.q_size + a.kv_size
        return _rows([(q0 + self.head_start * d, q0 + (self.head_start + self.heads) * d),
                      (k0 + self.kv_start * d, k0 + (self.kv_start + self.kv_heads) * d),
                      (v0 + self.kv_start * d, v0 + (self.kv_start + self.kv_heads) * d)])

    def vocab_rows(self) -> torch.Tensor:
        idx = torch.arange(self.vocab_start, self.vocab_start + self.vocab_per_rank)
        return torch.where(idx < self.arch.vocab_size, idx, torch.full_like(idx, -1))

    def head_rows(self, width: int) -> torch.Tensor:
        """The rows (or columns) of this rank's query heads in a [nh * width, ...] weight."""
        return _rows([(self.head_start * width, (self.head_start + self.heads) * width)])

    def specs(self) -> dict[str, ShardSpec]:
        """Our parameter name (as TransformerLM names it) -> its spec; replicated ones too."""
        a = self.arch
        vocab = ShardSpec(0, self.vocab_rows())
        out = {"embed_tokens.weight": vocab, "norm.weight": REPLICATED}
        if not a.tie_word_embeddings:
            out["lm_head.weight"] = vocab
        for n in range(a.num_layers):
            p = f"layers.{n}."
            out.update(self.mla_specs(p) if a.is_mla else self.attention_specs(p))
            out.update(self.moe_specs(p) if a.is_moe_layer(n) else
                       self.mlp_specs(p + "mlp.", a.intermediate_size))
            out[p + "input_layernorm.weight"] = REPLICATED
            out[p + "post_attention_layernorm.weight"] = REPLICATED
        return out

    def attention_specs(self, p: str) -> dict[str, ShardSpec]:
        a, out = self.arch, {}
        out[p + "self_attn.qkv_proj.weight"] = ShardSpec(0, self.qkv_rows())
        if a.qkv_bias:
            out[p + "self_attn.qkv_proj.bias"] = ShardSpec(0, self.qkv_rows())
        out[p + "self_attn.o_proj.weight"] = ShardSpec(1, self.head_rows(a.head_dim))
        if a.qk_norm:
            out[p + "self_attn.q_norm.weight"] = REPLICATED
            out[p + "self_attn.k_norm.weight"] = REPLICATED
        return out

    def mla_q_a(self) -> tuple[int, int]:
        """(global, local) width of qkv_a_proj's first (query) block."""
        a = self.arch
        if a.q_lora_rank is not None:
            return a.q_lora_rank, a.q_lora_rank
        return a.num_heads * a.qk_head_dim, self.heads * a.qk_head_dim

    def mla_specs(self, p: str) -> dict[str, ShardSpec]:
        a = self.arch
        q_a, _ = self.mla_q_a()
        q_rows = torch.arange(q_a) if a.q_lora_rank is not None else self.head_rows(a.qk_head_dim)
        a_rows = torch.cat([q_rows, torch.arange(q_a, q_a + a.kv_lora_rank + a.qk_rope_head_dim)])
        out = {p + "self_attn.qkv_a_proj.weight": ShardSpec(0, a_rows),
               p + "self_attn.kv_a_layernorm.weight": REPLICATED,
               p + "self_attn.kv_b_proj.weight":
                   ShardSpec(0, self.head_rows(a.qk_nope_head_dim + a.v_head_dim)),
               p + "self_attn.o_proj.weight": ShardSpec(1, self.head_rows(a.v_head_dim))}
        if a.qkv_bias:
            out[p + "self_attn.qkv_a_proj.bias"] = ShardSpec(0, a_rows)
        if a.q_lora_rank is not None:
            out[p + "self_attn.q_a_layernorm.weight"] = REPLICATED
            out[p + "self_attn.q_b_proj.weight"] = ShardSpec(0, self.head_rows(a.qk_head_dim))
        return out

    def mlp_specs(self, p: str, inter: int) -> dict[str, ShardSpec]:
        """A SwiGLU MLP of intermediate size `inter` (a dense layer, the shared experts)."""
        i = inter // self.size
        cols = _rows([(self.rank * i, (self.rank + 1) * i)])
        return {p + "gate_up_proj.weight": ShardSpec(0, torch.cat([cols, cols + inter])),
                p + "down_proj.weight": ShardSpec(1, cols)}

    def moe_specs(self, p: str) -> dict[str, ShardSpec]:
        a = self.arch
        out = {p + "mlp.gate.weight": REPLICATED}
        if a.scoring_func == "sigmoid":
            out[p + "mlp.gate.e_score_correction_bias"] = REPLICATED
        if self.expert_parallel:
            mine = ShardSpec(0, torch.arange(self.expert_start, self.expert_start + self.experts))
            out[p + "mlp.experts.gate_up_proj"] = out[p + "mlp.experts.down_proj"] = mine
        else:
            im, i = a.moe_intermediate_size, self.moe_inter
            cols = _rows([(self.rank * i, (self.rank + 1) * i)])
            out[p + "mlp.experts.gate_up_proj"] = ShardSpec(1, torch.cat([cols, cols + im]))
            out[p + "mlp.experts.down_proj"] = ShardSpec(2, cols)
        if a.n_shared_experts:
            out.update(self.mlp_specs(p + "mlp.shared_experts.",
                                      a.n_shared_experts * a.moe_intermediate_size))
        return out


def check_arch(arch: ModelArch, size: int, expert_parallel: bool = False) -> None:
    """One line naming the key and the numbers when `size` ranks cannot split `arch`."""
    key = f"engine.tensor_parallel={size}"
    if size < 1:
        raise ValueError(f"{key} must be >= 1")
    if arch.num_heads % size:
        raise ValueError(f"{key} does not divide the target's num_heads={arch.num_heads}; use "
                         f"a divisor of {arch.num_heads}")
    kv = arch.num_kv_heads
    if not arch.is_mla and kv % size and size % kv:  # MLA's one latent row: on every rank
        raise ValueError(f"{key} and the target's num_kv_heads={kv}: one must divide the "
                         "other (KV heads are split when it divides them, replicated when "
                         "they divide it)")
    if arch.is_mla and arch.qkv_bias and size > 1:
        raise ValueError(f"{key}: a DeepSeek target with attention_bias=true (an o_proj "
                         "bias) is not split yet; use engine.tensor_parallel=1")
    dense = any(not arch.is_moe_layer(n) for n in range(arch.num_layers))
    if dense and arch.intermediate_size % size:
        raise ValueError(f"{key} does not divide the target's intermediate_size="
                         f"{arch.intermediate_size}")
    _check_experts(arch, size, expert_parallel)


def _check_experts(arch: ModelArch, size: int, expert_parallel: bool) -> None:
    key = f"engine.tensor_parallel={size}"
    e, im = arch.n_routed_experts, arch.moe_intermediate_size
    if expert_parallel:
        if not e:
            raise ValueError("engine.expert_parallel=true needs a target with routed experts; "
                             f"{arch.architecture} has n_routed_experts=0")
        if e % size:
            raise ValueError(f"engine.expert_parallel=true: {key} does not divide the target's "
                             f"n_routed_experts={e}; use a divisor of {e}")
    elif e and im % size:
        raise ValueError(f"{key} does not divide the target's moe_intermediate_size={im} "
                         "(each expert's intermediate dimension is split); use a divisor, or "
                         "engine.expert_parallel=true")
    if arch.n_shared_experts and (arch.n_shared_experts * im) % size:
        raise ValueError(f"{key} does not divide the shared experts' intermediate size "
                         f"n_shared_experts x moe_intermediate_size={arch.n_shared_experts * im}")
