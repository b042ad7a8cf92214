"""`python -m precompute.distill target=smollm2 data=sharegpt data.limit=500 output_dir=runs/distill`."""
from inference_eval.hydra_app import run_cli
from precompute.distill.config import DistillConfig
from precompute.distill.run import main

if __name__ == "__main__":
    run_cli("distill", DistillConfig, main)
