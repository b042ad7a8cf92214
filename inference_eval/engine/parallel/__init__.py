"""Tensor parallelism for the engine, applied from outside the single-device model code.

group.py opens the process groups (torchrun env, NCCL on CUDA, gloo on CPU); shard.py decides
which rows or columns of every weight a rank holds; layers.py and moe.py (DeepSeek's experts,
TP or EP) have the parallel forms that tp.py swaps in; loading.py reads only a rank's slices
of the safetensors; step_sync.py carries each model call (the target's or a draft head's)
from the group's rank 0 to the others; spec.py splits a draft head with the target;
runner.py ties them to LLMEngine. Model and head files never call torch.distributed:
everything that does is here.
"""
