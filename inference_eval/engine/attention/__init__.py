"""Attention backends behind one interface: plan once per step, attend per layer."""
from inference_eval.engine.attention.layout import BatchLayout
from inference_eval.engine.attention.plan import AttentionBackend, AttentionPlan, make_backend

__all__ = ["AttentionBackend", "AttentionPlan", "BatchLayout", "make_backend"]
