"""Draft heads (training form). They reuse the engine's decoder layer and run in the engine
through the same weights; the frozen embedding, final norm and lm_head come from the target."""
import inference_eval.engine  # noqa: E402,F401  (first: OpenBLAS settings, before torch loads numpy)
