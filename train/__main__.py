"""`python -m train target=smollm2 head=mtp data.shards=runs/shards output_dir=runs/head`."""
from inference_eval.hydra_app import run_cli
from train.config import TrainConfig
from train.loop import train

if __name__ == "__main__":
    run_cli("train", TrainConfig, train)
