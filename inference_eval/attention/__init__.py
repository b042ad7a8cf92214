"""Attention backends behind one interface: plan once per step, attend per layer."""
from inference_eval.attention.layout import BatchLayout
from inference_eval.attention.plan import AttentionBackend, AttentionPlan, make_backend

__all__ = ["AttentionBackend", "AttentionPlan", "BatchLayout", "make_backend"]
