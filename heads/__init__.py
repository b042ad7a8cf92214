"""Draft heads (training form). They reuse the engine's decoder layer and run in the engine
through the same weights; the frozen embedding, final norm and lm_head come from the target."""
