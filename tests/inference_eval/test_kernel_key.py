"""Kernel builds are keyed by the instruction set -march=native resolves to, so a build cache
shared between machines (a shared home, a copied venv) never hands one CPU's code to another.
No compiles here: the probe is faked, and torch's loader is replaced where a build would run."""
from pathlib import Path

import pytest

from inference_eval.engine import native

GCC = (' /usr/lib/gcc/x86_64-linux-gnu/12/cc1plus -quiet -imultiarch x86_64-linux-gnu '
       '-D_GNU_SOURCE /dev/null "-march=znver3" -mmmx -msse -mavx2 -mavx512f -mno-amx-tile '
       '--param "l1-cache-size=32" --param "l2-cache-size=1024" "-mtune=znver3" -quiet '
       '-o /tmp/ccaeaUjB.s\n as --64 -o /dev/null /tmp/ccaeaUjB.s\n')
CLANG = (' "/usr/bin/clang-16" "-cc1" "-triple" "x86_64-pc-linux-gnu" "-target-cpu" "znver4" '
         '"-target-feature" "+avx512f" "-target-feature" "-amx-tile" "-tune-cpu" "generic" '
         '"-fdebug-compilation-dir=/tmp" "-o" "/dev/null"\n')


@pytest.fixture(autouse=True)
def fresh_key():
    """isa_key() is probed once per process: forget a faked one before and after each test,
    so other tests build under this machine's real key."""
    native.isa_key.cache_clear()
    yield
    native.isa_key.cache_clear()


def test_the_same_flags_give_the_same_key_and_other_flags_another():
    avx512 = "-march=znver3 -mavx2 -mavx512f"
    assert native.key_of(avx512) == native.key_of(avx512)
    assert native.key_of(avx512) != native.key_of("-march=haswell -mavx2 -mno-avx512f")
    assert len(native.key_of(avx512)) == 8 and int(native.key_of(avx512), 16) >= 0


def test_two_instruction_sets_get_two_module_names_and_build_directories(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    from torch.utils.cpp_extension import _get_build_directory

    src = Path("inference_eval/engine/model/cpu_linear.cpp")
    names = {}
    for flags in ("-march=znver3 -mavx512f", "-march=haswell -mavx2", "-march=znver3 -mavx512f"):
        native.isa_key.cache_clear()
        monkeypatch.setattr(native, "target_flags", lambda flags=flags: flags)
        names.setdefault(flags, set()).add(native.module_name(src))
    assert all(len(v) == 1 for v in names.values())  # the same flags: the same name again
    (avx512,), (avx2,) = names.values()
    assert avx512 != avx2
    assert avx512 == f"specheads_cpu_linear_{native.key_of('-march=znver3 -mavx512f')}"
    dirs = {_get_build_directory(n, verbose=False) for n in (avx512, avx2)}
    assert len(dirs) == 2


def test_the_key_is_probed_once_per_process(monkeypatch):
    calls = []
    monkeypatch.setattr(native, "target_flags", lambda: calls.append(1) or "-mavx2")
    assert native.isa_key() == native.isa_key() == native.key_of("-mavx2")
    assert len(calls) == 1


def test_build_loads_and_unlocks_under_the_keyed_name(monkeypatch):
    """build() hands torch's loader, and the stale-lock check before it, the keyed name."""
    import torch.utils.cpp_extension as ext

    monkeypatch.setattr(native, "target_flags", lambda: "-march=haswell -mavx2")
    seen = {}
    monkeypatch.setattr(native, "clear_stale_lock", lambda name: seen.setdefault("lock", name))
    monkeypatch.setattr(ext, "load", lambda name, **kw: seen.setdefault("load", name))
    src = Path("inference_eval/engine/model/cpu_fused.cpp")
    want = f"specheads_cpu_fused_{native.key_of('-march=haswell -mavx2')}"
    assert native.build(src, "torch's ops") == want
    assert seen == {"lock": want, "load": want}


def test_the_driver_output_keeps_instruction_flags_only():
    gcc = native.driver_target_flags(GCC)
    assert gcc == sorted(["-march=znver3", "-mmmx", "-msse", "-mavx2", "-mavx512f",
                          "-mno-amx-tile"])  # no -mtune, cache params, paths or `as`
    assert native.driver_target_flags(GCC.replace("-mavx2 -mavx512f", "-mavx512f -mavx2")) == gcc
    assert native.driver_target_flags(CLANG) == ["-target-cpu znver4",
                                                 "-target-feature +avx512f",
                                                 "-target-feature -amx-tile"]


def test_without_a_compiler_probe_the_cpu_flags_key_the_build(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: sse2 avx2 fpu\n\nprocessor\t: 1\n"
                       "flags\t\t: sse2 avx2 fpu avx512f\n")
    assert native.cpuinfo_flags(str(cpuinfo)).endswith(" avx2 fpu sse2")  # the first CPU's
    assert native.cpuinfo_flags(str(tmp_path / "absent")) == ""
    real = native.cpuinfo_flags
    monkeypatch.setattr(native, "cpuinfo_flags", lambda: real(str(cpuinfo)))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert native.target_flags() == real(str(cpuinfo))
