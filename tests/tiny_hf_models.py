"""Tiny random Hugging Face checkpoints of each supported family (imported by tests as
`tiny_hf_models`; a plain module, since several conftest.py files would shadow each other)."""
from __future__ import annotations

import torch

# family -> HF config kwargs; every family exercises a different flag of ModelArch.
FAMILIES = {
    "llama3": dict(model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 64}, tie_word_embeddings=False),
    "smollm2": dict(model_type="llama", tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=False, head_dim=24),
}


def make_tiny_hf(family: str, path, seed: int = 0):
    """Save a tiny random HF model of `family` to `path`; every weight perturbed so biases and
    norms are non-trivial. Returns the HF model (fp32, eval)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(FAMILIES[family])
    model_type = kw.pop("model_type")
    cfg = AutoConfig.for_model(
        model_type, vocab_size=320, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(path)
    return model
