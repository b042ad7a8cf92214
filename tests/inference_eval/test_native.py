"""The engine's kernel builder: every kernel source is found and built (or cached), and a
source that does not compile leaves its caller's torch path with a warning, not a crash."""
import warnings

import pytest

from inference_eval.engine import native
from kernel_checks import CHECKS


def test_every_kernel_source_sits_beside_the_module_that_loads_it():
    srcs = native.sources()
    assert {s.name for s in srcs} >= {"cpu_causal.cpp", "cpu_paged.cpp", "cpu_fused.cpp",
                                      "cpu_linear.cpp"}
    for src in srcs:
        caller = src.with_suffix(".py")
        assert caller.exists(), f"{src} has no module beside it"
        assert "native.build(" in caller.read_text(), f"{caller} does not build {src.name}"


def test_build_all_builds_or_finds_every_kernel():
    done = native.build_all(jobs=2)
    assert [s for s, _ in done] == native.sources()
    assert all(ok for _, ok in done), [s.name for s, ok in done if not ok]
    assert sorted(CHECKS) == sorted(s.name for s, _ in done)  # a check for every kernel
    for src, _ in done:  # what was built (or found) computes: one result against torch
        CHECKS[src.name]()


def test_a_source_that_does_not_compile_warns_and_returns_none(tmp_path):
    bad = tmp_path / "broken_kernel.cpp"
    bad.write_text('#include "no_such_header.h"\n')
    with pytest.warns(UserWarning, match="(?s)broken_kernel.cpp could not be built.*no_such_header.*torch path"):
        assert native.build(bad, "the torch path serves") is None


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path, monkeypatch):
    """A build killed inside torch's lock leaves the lock file; every later load would wait
    on it forever. One older than STALE_LOCK_S goes (with a warning); a fresh one stays."""
    import os
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    lock = __import__("pathlib").Path(_get_build_directory("specheads_x", verbose=False)) / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    assert native.clear_stale_lock("specheads_x") is None and lock.exists()  # a live build
    old = time.time() - native.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="stale build lock"):
        assert native.clear_stale_lock("specheads_x") == lock
    assert not lock.exists()
    assert native.clear_stale_lock("specheads_x") is None  # nothing there: nothing to do
