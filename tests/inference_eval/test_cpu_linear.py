"""The CPU kernel (inference_eval/engine/model/cpu_linear.{py,cpp}): every row count, a few
rows or many in chunks, with and without bias, on any thread count, equals a float64
product; it is used exactly where applies() says (up to the row count that won the race
against OpenBLAS), in eager steps and inside compiled graphs."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from inference_eval.engine.model import cpu_linear
from inference_eval.engine.model.linear import Linear, matmul_wt, set_cpu_blas


@pytest.fixture(scope="module")
def width():
    # The engine keeps its OpenBLAS paths without the kernel; on a machine with torch's
    # compiler toolchain (which inductor needs too) that fallback must not hide a broken build.
    assert cpu_linear.enable(2)
    return cpu_linear.kernel().vector_width()


def weights(out, inn, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out, inn, generator=g), torch.randn(out, generator=g)


# Past 128 rows (the chunk, cpu_linear.cpp) a product runs chunk by chunk: 129 and 257 leave
# one row, 130 two, 300 a chunk of 44 after two full ones.
@pytest.mark.parametrize("rows", list(range(0, 9)) + [11, 16, 47, 128, 129, 130, 257, 300])
@pytest.mark.parametrize("out,inn", [(8, 16), (96, 64), (200, 576)])
def test_every_row_count_matches_float64(width, rows, out, inn):
    w, b = weights(out, inn, rows)
    x = torch.randn(rows, inn, generator=torch.Generator().manual_seed(rows + 100))
    ref = x.double() @ w.double().t()
    with torch.inference_mode():
        assert cpu_linear.applies(x, w) == (rows <= cpu_linear.max_rows())
        got = cpu_linear.kernel().small_linear(x, w, None, 2)
        got_b = cpu_linear.kernel().small_linear(x, w, b, 2)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got_b.double(), ref + b.double(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [5, 300])
def test_threads_split_rows_without_changing_a_bit(width, rows):
    w, b = weights(1024, 576, 0)  # 128 blocks of 8 outputs: both thread counts split them
    x = torch.randn(rows, 576)
    kern = cpu_linear.kernel()
    one, two = kern.small_linear(x, w, b, 1), kern.small_linear(x, w, b, 2)
    assert torch.equal(one, two)


def test_race_keeps_the_kernel_as_far_as_it_wins(monkeypatch):
    # Timings by row count (seconds); the kernel serves SMALL_ROWS whatever they say.
    small, mid, big = cpu_linear.RACE_ROWS
    pick = cpu_linear.pick_max_rows
    assert pick({small: 1.0, mid: 2.0, big: 5.0}, {small: 2.0, mid: 3.0, big: 9.0}) == cpu_linear.ALL_ROWS
    assert pick({small: 1.0, mid: 2.0, big: 9.0}, {small: 2.0, mid: 3.0, big: 5.0}) == mid
    assert pick({small: 1.0, mid: 4.0, big: 1.0}, {small: 2.0, mid: 3.0, big: 5.0}) == small
    assert pick({small: 3.0, mid: 1.0, big: 1.0}, {small: 2.0, mid: 3.0, big: 5.0}) == cpu_linear.SMALL_ROWS
    # Measured here: whatever it picked, applies() follows it.
    with torch.inference_mode():
        past = torch.randn(cpu_linear.SMALL_ROWS + 1, 64)
        assert cpu_linear.applies(past, torch.randn(96, 64)) == (
            cpu_linear.max_rows() > cpu_linear.SMALL_ROWS)
    assert cpu_linear.serves_all_rows() == (cpu_linear.max_rows() == cpu_linear.ALL_ROWS)


def test_race_verdict_is_kept_and_read_by_later_processes(width, tmp_path, monkeypatch):
    """The race runs once per machine, build and thread count: a second process (here: the
    cache cleared) reads the kept verdict instead of racing, so both sum in the same order
    (a resumed precompute writes the same bytes). A damaged verdict file is raced again."""
    path = tmp_path / "verdict.json"
    monkeypatch.setattr(cpu_linear, "verdict_path", lambda: path)
    cpu_linear.max_rows.cache_clear()
    try:
        first = cpu_linear.max_rows()  # raced here, and written
        assert cpu_linear.read_verdict(path) == first
        cpu_linear.write_verdict(path, cpu_linear.RACE_ROWS[0], {})
        cpu_linear.max_rows.cache_clear()
        with monkeypatch.context() as m:
            m.setattr(cpu_linear, "time_paths", lambda *a, **k: pytest.fail("raced again"))
            assert cpu_linear.max_rows() == cpu_linear.RACE_ROWS[0]
        path.write_text("{not json")
        assert cpu_linear.read_verdict(path) is None
        cpu_linear.max_rows.cache_clear()
        assert cpu_linear.max_rows() in (cpu_linear.SMALL_ROWS, *cpu_linear.RACE_ROWS[:-1],
                                         cpu_linear.ALL_ROWS)
        assert cpu_linear.read_verdict(path) is not None  # rewritten
    finally:
        cpu_linear.max_rows.cache_clear()  # later tests read the machine's own verdict


def test_applies_only_where_the_kernel_can_run(width):
    w = torch.randn(96, 64)
    x = torch.randn(4, 64)
    with torch.inference_mode():
        assert cpu_linear.applies(x, w)
        assert not cpu_linear.applies(x.double(), w.double())
        assert not cpu_linear.applies(x, w.t().contiguous().t())  # not [out, in] contiguous
        odd_in = 64 + width // 2  # not a multiple of the built vector width (8 or 16 floats)
        assert not cpu_linear.applies(torch.randn(4, odd_in), torch.randn(96, odd_in))
        assert not cpu_linear.applies(x, torch.randn(90, 64))  # out % 8
    assert not cpu_linear.applies(x, w)  # grad mode: training keeps F.linear
    with pytest.raises(RuntimeError, match="out % 8"):
        cpu_linear.kernel().small_linear(x, torch.randn(90, 64), None, 1)


def test_linear_layers_take_it_and_fall_back(width):
    lin = Linear(64, 96, bias=True)
    set_cpu_blas(lin, True)
    with torch.inference_mode():
        for rows in (1, 5, 16, 17, 40, 300):  # the kernel, then whichever won the race
            x = torch.randn(rows, 64)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        odd = torch.randn(72, 64)  # out % 8 != 0: the fallback
        torch.testing.assert_close(matmul_wt(x[:3], odd, True), x[:3] @ odd.t(), rtol=1e-5, atol=1e-5)


def test_compiled_graph_calls_the_kernel(width):
    w, b = weights(96, 64, 3)
    x = torch.randn(5, 64)

    def f(x):
        return torch.relu(matmul_wt(x, w, True, b)) * 2

    with torch.inference_mode():
        eager = f(x)
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True)
        got = compiled(x)
        graph_ops = []
        torch._dynamo.reset()
        torch.compile(f, fullgraph=True, backend=lambda gm, _: graph_ops.extend(
            str(n.target) for n in gm.graph.nodes) or gm)(x)
    assert torch.equal(got, eager)
    assert any("small_linear" in op for op in graph_ops)


def test_race_times_each_path_after_its_first_calls(monkeypatch):
    # A path whose first calls are slow (its threads starting, the clock ramping up after a
    # build) must not lose the race for them: that verdict is kept for the build and once
    # sent every prefill product to the slower path.
    calls = []

    class SlowStart:
        def small_linear(self, x, w, bias, threads):
            calls.append(1)
            if len(calls) <= len(cases):  # the first call of each case
                time.sleep(0.05)
            return x @ w.t()

    cases = {m: [(torch.randn(m, 32), torch.randn(16, 32))] for m in cpu_linear.RACE_ROWS}
    monkeypatch.setattr(cpu_linear, "kernel", lambda: SlowStart())
    secs = cpu_linear.time_paths(cases, reps=3)
    assert max(secs["kernel"].values()) < 0.04
    assert len(calls) == len(cases) * 4  # one untimed, then three timed, per case
