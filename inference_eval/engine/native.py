"""Build the engine's C++ CPU kernels once per instruction set (torch's extension loader).

Each kernel is one .cpp beside the module that calls it (attention/cpu_paged.cpp,
model/cpu_linear.cpp, ...), built as the module `specheads_<file stem>_<isa key>`. They are
compiled for the machine they run on (-march=native: AVX-512 where the CPU has it, AVX2
elsewhere) with the g++ and ninja that inductor's CPU backend uses, and cached under torch's
extension directory (~16 s each the first time on 2 cores, 0.2 s to load after; ninja's
dependency files rebuild one whose headers changed). They include kernel_api.h, not
<torch/extension.h>: the whole C++ frontend doubled every build. Where a kernel cannot be
built, its caller keeps its torch path and says why once.

The isa key (`isa_key()`, 8 hex digits) hashes what -march=native resolves to here: torch
keys its cache by module name, and the literal flag "-march=native" is the same string on
every machine, so without the key a cache shared between machines (a shared home, a copied
venv or container) would hand one CPU's build to another, and AVX-512 code dies with SIGILL
on an AVX2 machine. The compiler's driver says what it would pass its compiler proper
(`c++ -march=native -###`: gcc's -march=<cpu> and every -m<isa> / -mno-<isa>, clang's
-target-cpu and -target-feature), since the CPU name alone is not enough (gcc 12 calls a
Zen 4, AVX-512 included, znver3). Where that probe fails, /proc/cpuinfo's CPU flags stand in.
Machines with the same instruction set share a build; a compiler that resolves the same CPU
differently builds its own.

`python -m inference_eval.engine.native` (scripts/setup_env.sh runs it) builds every kernel
at once, one process each, so a fresh machine pays for them in parallel and before the
first run rather than one by one inside it.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shlex
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
          "-fassociative-math",  # vectorised dot products; inf/NaN semantics kept
          "-fopenmp"]  # OpenMP: at::parallel_for's pragma and the kernels' own


@functools.cache
def isa_key() -> str:
    """8 hex digits naming the instruction set the kernels are built for on this machine
    (target_flags() hashed; probed once per process)."""
    return key_of(target_flags())


def key_of(flags: str) -> str:
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


def module_name(source: Path) -> str:
    """The extension name (and so the cache directory) of kernel `source`:
    specheads_<stem>_<isa key>."""
    return f"specheads_{source.stem}_{isa_key()}"


def target_flags() -> str:
    """What -march=native means here, as one line: the compiler's resolved target flags, else
    the CPU's flags from /proc/cpuinfo, else the machine's architecture name."""
    cxx = shlex.split(os.environ.get("CXX", "c++"))  # the compiler torch's loader runs
    try:
        r = subprocess.run([*cxx, "-march=native", "-###", "-x", "c++", "-c", os.devnull,
                            "-o", os.devnull], capture_output=True, text=True, timeout=60)
        flags = driver_target_flags(r.stderr) if r.returncode == 0 else []
    except (OSError, ValueError, subprocess.SubprocessError):
        flags = []
    if flags:
        return " ".join(flags)
    return cpuinfo_flags() or f"machine={platform.machine()}"


def driver_target_flags(driver_out: str) -> list[str]:
    """The instruction-set flags in a compiler driver's `-###` output (its compiler-proper
    command line): gcc's -march=<cpu> and -m<isa> / -mno-<isa> flags, clang's -target-cpu and
    -target-feature pairs; tuning (-mtune, cache-size params) and paths left out, so only what
    decides the instructions keys a build. Sorted: the order carries no meaning."""
    out: set[str] = set()
    for line in driver_out.splitlines():
        if "cc1" not in line:  # gcc's cc1plus, clang's -cc1
            continue
        try:
            toks = shlex.split(line)
        except ValueError:
            continue
        for i, tok in enumerate(toks):
            if tok in ("-target-cpu", "-target-feature") and i + 1 < len(toks):
                out.add(f"{tok} {toks[i + 1]}")
            elif tok.startswith("-m") and not tok.startswith("-mtune"):
                out.add(tok)
    return sorted(out)


def cpuinfo_flags(path: str = "/proc/cpuinfo") -> str:
    """The first CPU's instruction-set flags (x86 `flags`, Arm `Features`), or ''."""
    try:
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return f"{platform.machine()} {' '.join(sorted(value.split()))}"
    except OSError:
        pass
    return ""


# A build holds torch's lock file while it runs (~16-60 s); a process killed inside one leaves
# the file behind, and every later load would wait on it forever without a word.
STALE_LOCK_S = 600


def clear_stale_lock(name: str, max_age_s: float = STALE_LOCK_S) -> Path | None:
    """Remove the build lock of extension `name` when it is older than max_age_s (its builder
    is gone); returns the removed path, else None."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
        if time.time() - lock.stat().st_mtime <= max_age_s:
            return None
        lock.unlink()
    except (ImportError, OSError):  # no lock (the usual case), or torch moved its helper
        return None
    warnings.warn(f"removed a stale build lock {lock} (older than {max_age_s:.0f} s: a build "
                  "was killed inside it)", stacklevel=3)
    return lock


def build(source: Path, fallback: str):
    """The compiled module of `source` (named module_name(source)), or None (with one warning
    naming `fallback`, what serves instead) where it cannot be built."""
    try:
        from torch.utils.cpp_extension import load

        name = module_name(source)
        clear_stale_lock(name)
        return load(name=name, sources=[str(source)], extra_cflags=_FLAGS,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler or ninja
        warnings.warn(f"the CPU kernel {source.name} could not be built ({exc}); {fallback}",
                      stacklevel=3)
        return None


def sources() -> list[Path]:
    """Every kernel source of the engine."""
    return sorted(Path(__file__).parent.rglob("*.cpp"))


def build_all(jobs: int | None = None) -> list[tuple[Path, bool]]:
    """Build every kernel, `jobs` at a time (default: one per core), each in its own
    process (torch's loader is not meant to run twice at once in one). Returns (source,
    built) pairs; a failure prints its reason and leaves the torch path to serve."""
    code = ("import sys; from pathlib import Path;"
            "from inference_eval.engine.native import build;"
            "sys.exit(build(Path(sys.argv[1]), 'its torch path serves') is None)")

    def one(src: Path) -> tuple[Path, bool]:
        r = subprocess.run([sys.executable, "-c", code, str(src)], capture_output=True, text=True)
        if r.returncode:
            print(f"CPU kernel {src.name} not built: {r.stderr.strip()[-2000:]}", file=sys.stderr)
        return src, r.returncode == 0

    with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        return list(pool.map(one, sources()))


if __name__ == "__main__":
    if sys.argv[1:] == ["--key"]:  # scripts/setup_env.sh's kernel stamp
        print(isa_key())
        sys.exit()
    t0 = time.perf_counter()
    done = build_all()
    took = time.perf_counter() - t0
    if took > 5 or not all(ok for _, ok in done):  # quiet when every kernel was cached
        print(f"CPU kernels: {sum(ok for _, ok in done)}/{len(done)} built or cached "
              f"in {took:.0f} s")
