"""Build the engine's C++ CPU kernels once per machine (torch's extension loader).

Each kernel is one .cpp beside the module that calls it (attention/cpu_paged.cpp,
model/cpu_linear.cpp). They are compiled for the machine they run on (-march=native: AVX-512
where the CPU has it, AVX2 elsewhere) with the g++ and ninja that inductor's CPU backend uses,
and cached under torch's extension directory (~30-60 s the first time on 2 cores, 0.2 s to
load after). Where a kernel cannot be built, its caller keeps its torch path and says why once.
"""
from __future__ import annotations

import warnings
from pathlib import Path

_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
          "-fassociative-math",  # vectorised dot products; inf/NaN semantics kept
          "-fopenmp"]  # OpenMP: at::parallel_for's pragma and the kernels' own


def build(name: str, source: Path, fallback: str):
    """The compiled module of `source`, or None (with one warning naming `fallback`, what
    serves instead) where it cannot be built."""
    try:
        from torch.utils.cpp_extension import load

        return load(name=name, sources=[str(source)], extra_cflags=_FLAGS,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler or ninja
        warnings.warn(f"the CPU kernel {source.name} could not be built ({exc}); {fallback}",
                      stacklevel=3)
        return None
