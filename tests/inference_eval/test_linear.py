"""The CPU fast path of model/linear.py: every row count's dispatch equals F.linear, for a
weight that fits the cache (GEMVs up to 8 rows) and one that does not (GEMVs up to 3)."""
import pytest
import torch
import torch.nn.functional as F

from inference_eval.engine.model.linear import (CACHED_WEIGHT_BYTES, GEMV_ROWS_CACHED,
                                                GEMV_ROWS_STREAMED, gemv_rows, matmul_wt)


@pytest.mark.parametrize("out_features", [96, CACHED_WEIGHT_BYTES // (4 * 48) + 1])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 9, 40])
def test_every_row_count_matches_f_linear(rows, out_features):
    g = torch.Generator().manual_seed(rows)
    # The engine's column-major layout (set_cpu_blas): W.t() is C-contiguous.
    w = torch.randn(out_features, 48, generator=g).t().contiguous().t()
    x = torch.randn(rows, 48, generator=g)
    with torch.inference_mode():
        got = matmul_wt(x, w, True)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_gemv_rows_by_weight_size():
    assert gemv_rows(torch.empty(3072, 576)) == GEMV_ROWS_CACHED
    assert gemv_rows(torch.empty(49152, 576)) == GEMV_ROWS_STREAMED
