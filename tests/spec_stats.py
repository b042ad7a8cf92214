"""Statistics shared by the sampled-speculation tests: the target's exact joint law of the
first two generated tokens, and the one chi-square goodness-of-fit p-value every lossless
sampling test uses."""
from __future__ import annotations

import torch

from inference_eval.engine.attention import BatchLayout
from inference_eval.engine.attention.torch_backend import TorchAttentionBackend
from inference_eval.engine.sampling import SamplingParams, SamplingTensors, processed_probs


@torch.no_grad()
def joint_first_two(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """[V, V] fp64: P(x_1 = a, x_2 = b) under the target with `params` (temperature, top-k,
    top-p), computed exactly by one forward per possible first token."""
    st = SamplingTensors.from_params([params])
    be, n = TorchAttentionBackend(), len(prompt)
    v = model.arch.vocab_size
    p1 = processed_probs(model(torch.tensor(prompt), be.plan(BatchLayout.packed([n]))).logits[-1:], st)[0]
    joint = torch.zeros(v, v, dtype=torch.float64)
    for t1 in p1.nonzero().flatten().tolist():
        lg = model(torch.tensor(prompt + [t1]), be.plan(BatchLayout.packed([n + 1]))).logits[-1:]
        joint[t1] = p1[t1].double() * processed_probs(lg, st)[0].double()
    return joint


def first_two_counts(results, v: int) -> torch.Tensor:
    counts = torch.zeros(v, v, dtype=torch.float64)
    for r in results:
        counts[r.token_ids[0], r.token_ids[1]] += 1
    return counts


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of `counts` against the law `probs` (same number of cells,
    any shape). A cell of probability 0 expects no draw, so it is left out of the statistic
    (its term would divide by zero), but a draw there fails at once: the sampler emitted what
    the target never does, whatever the other cells say."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    live = probs > 0
    stray = int(counts[~live].sum())
    assert stray == 0, f"{stray} draws fell in cells of target probability 0"
    assert int(live.sum()) >= 2, "a law on one cell leaves nothing to test"
    exp = counts.sum() * probs[live] / probs[live].sum()
    stat = ((counts[live] - exp) ** 2 / exp).sum()
    dof = torch.tensor(float(live.sum() - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))
