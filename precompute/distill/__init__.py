"""Self-distillation: the target answers prompts itself, and the answers become training chats.

    python -m precompute.distill target=smollm2 data=sharegpt data.limit=500 output_dir=runs/distill
    python -m precompute target=smollm2 data=jsonl data.path=runs/distill/conversations.jsonl ...

Heads trained on the target's own outputs accept more at serving time, because that is the
distribution they draft against. What lives where:
- config.py: `DistillConfig` (conf/distill.yaml);
- run.py: the job, a page long (`main` for the CLI, `run_distill` for precompute's
  data.regenerate);
- answer.py: one batch of prompts answered turn by turn through `LLMEngine.generate`;
- ledger.py: what is already answered, which batches remain, the final merge;
- store.py: the SIGKILL-safe JSONL logs and the files of an output_dir;
- manifest.py: `distill_manifest.json` and the plan hash.
"""
from precompute.distill.config import DistillConfig
from precompute.distill.manifest import DistillManifest
from precompute.distill.run import main, run_distill

__all__ = ["DistillConfig", "DistillManifest", "main", "run_distill"]
