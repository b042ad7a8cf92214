"""Typed configs of the inference stage (registered with Hydra in inference_eval/cli_config.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")


@dataclass
class EngineConfig:
    """KV cache: `num_pages` pages of `page_size` tokens; when num_pages is None it is sized
    from `kv_cache_gb`. `max_batched_tokens` caps tokens per step (prefill admission)."""

    attention: str = "auto"
    device: str = "auto"
    page_size: int = 16
    num_pages: int | None = None
    kv_cache_gb: float = 0.5
    max_batch_size: int = 64
    max_batched_tokens: int = 4096
    max_context: int | None = None
    seed: int = 0
    threads: int | None = None
    # CPU fp32 GEMMs through numpy's OpenBLAS (see model/linear.py): auto = on for CPU fp32.
    cpu_blas: str = "auto"
    # On that path, read the target's small-row products from its weights' exact GGUF block
    # code where there is one (model/cpu_quant.py: the same floats, a 4-5x shorter stream);
    # false keeps the fp32 weights (the same results, for comparisons).
    weight_codes: bool = True
    # On that path, round a draft head's trained weights to this GGUF block code (q8_0: 8-bit
    # blocks of 32 with an fp16 scale; or none) so its small-row products read it too: a
    # draft step streams ~4x fewer bytes. It changes the head's floats slightly (drafts, never
    # outputs: verification keeps greedy decoding lossless); none keeps the trained fp32 head.
    head_code: str = "q8_0"
    # Compile decode/verification steps of up to 16 rows with inductor (CPU fp32, dense GQA
    # targets; model/compiled.py): ~1.5x faster steps, ~75 s of compile per row count on 2
    # cores, paid on first use (engines `warm` the counts a run uses before timing it).
    compile: bool = False
    # On CUDA with FlashInfer attention: replay decode, chain-verification and draft steps as
    # CUDA graphs (model/cuda_graphs.py), each captured on first use; false runs them eagerly.
    cuda_graphs: bool = True
    # Ranks per tensor-parallel replica (launch with torchrun; inference_eval/engine/parallel/),
    # and the seconds a rank waits on the others before it stops with an error.
    tensor_parallel: int = 1
    tp_timeout_s: float = 300.0
    # DeepSeek targets under tensor_parallel > 1: split the routed experts whole over the
    # replica's ranks (expert parallelism) instead of each expert's intermediate dimension.
    expert_parallel: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"engine.attention={self.attention!r}: use one of {ATTENTION_BACKENDS}")
        for key in ("page_size", "max_batch_size", "max_batched_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"engine.{key} must be >= 1, got {getattr(self, key)}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"engine.num_pages must be >= 1, got {self.num_pages}")
        if self.cpu_blas not in ("auto", "numpy", "torch"):
            raise ValueError(f"engine.cpu_blas={self.cpu_blas!r}: use auto, numpy or torch")
        from inference_eval.engine.model.cpu_quant import CODE_FORMATS

        if self.head_code != "none" and self.head_code not in CODE_FORMATS:
            raise ValueError(f"engine.head_code={self.head_code!r}: use none or one of "
                             f"{sorted(CODE_FORMATS)}")
        if self.tensor_parallel < 1:
            raise ValueError(f"engine.tensor_parallel must be >= 1, got {self.tensor_parallel}")
        if self.tensor_parallel > 1 and self.compile:
            raise ValueError("engine.compile=true is single-device: use it with "
                             "engine.tensor_parallel=1")
        if self.expert_parallel and self.tensor_parallel < 2:
            raise ValueError("engine.expert_parallel=true splits the routed experts over the "
                             "tensor-parallel ranks: it needs engine.tensor_parallel > 1, got "
                             f"{self.tensor_parallel}")
        if self.tp_timeout_s <= 0:
            raise ValueError(f"engine.tp_timeout_s must be > 0, got {self.tp_timeout_s}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"engine.kv_cache_gb must be > 0, got {self.kv_cache_gb}")

    def resolve_num_pages(self, bytes_per_token: int) -> int:
        if self.num_pages is not None:
            return self.num_pages
        return max(1, int(self.kv_cache_gb * (1 << 30)) // (bytes_per_token * self.page_size))

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
