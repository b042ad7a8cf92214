"""The engine (`engine/`: target model, KV pages, scheduler, attention backends, speculative
schemes) and what measures heads with it (`evaluation/`: prompts, runs, metrics, reports)."""
