"""`python -m precompute target=smollm2 data=sharegpt data.limit=200 output_dir=runs/shards`."""
from inference_eval.hydra_app import run_cli
from precompute.config import PrecomputeConfig
from precompute.run import main

if __name__ == "__main__":
    run_cli("precompute", PrecomputeConfig, main)
