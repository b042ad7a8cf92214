"""What measures heads with the engine: prompt sets, the evaluation run (`python -m
inference_eval`), acceptance metrics and reports."""
