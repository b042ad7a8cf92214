"""`python -m inference_eval target=... draft=... prompts=... output_dir=...`: the acceptance
eval (inference_eval/evaluation/evaluate.py; config in conf/eval.yaml and inference_eval/evaluation/config.py)."""
from inference_eval.evaluation.config import EvalConfig
from inference_eval.evaluation.evaluate import main
from inference_eval.hydra_app import run_cli

if __name__ == "__main__":
    run_cli("eval", EvalConfig, main)
