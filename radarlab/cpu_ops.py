"""radarlab's C++ operators for the CPU, compiled on first use: the engine's fast path, not a dependency.

vLLM's CPU backend is PyTorch plus a library of its own C++ kernels (paged attention, rms_norm,
silu_and_mul, rotary embedding), because on a CPU each small torch op costs a dispatch and a pass
over memory. radarlab does the same, in course-sized form: the sources are in radarlab/csrc, one
file per concern, and torch.utils.cpp_extension builds them into one library that registers
torch.ops.radarlab.* (seconds with gcc or clang and ninja).

The build is for the CPU at hand (-march=native: AVX-512 where the CPU has it, AVX2 where not;
RADARLAB_CPU_MARCH=haswell, say, builds for another; RADARLAB_CPU_OPS_ONE_UNIT=1 compiles csrc/ as one
translation unit, see unity_source) and is cached under $RADARLAB_CACHE/kernels, per
CPU kind and -march. Where it cannot be built, callers keep their
torch code (the reference every op is tested against) and a warning says why, once. The compiler is
$CXX, else the first of c++, g++, clang++ on PATH (find_compiler); where one exists the build is
expected to work, and the tests fail, rather than skip, when it does not.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
# paged_decode.cpp last: in a one-unit build (unity_source) its `using namespace` then reaches no other file.
SOURCES = ("cache_ops.cpp", "layernorm.cpp", "activation.cpp", "rotary.cpp", "gemv.cpp", "argmax.cpp",
           "paged_decode.cpp")
# -fopenmp: at::parallel_for is inline OpenMP, run by the libgomp torch has already loaded, so these
# kernels share torch's threads. -march is added per build. No -ffast-math: -inf and NaN stay IEEE.
CFLAGS = ("-O3", "-fno-math-errno", "-fopenmp")
COMPILERS = ("c++", "g++", "clang++")  # looked for on PATH in this order where $CXX is not set


class CpuOpsUnavailable(RuntimeError):
    """The C++ operators could not be built here; the message says why."""


def load_cpu_ops():
    """Build (once per machine; later processes load the cached library) and return torch.ops.radarlab.
    Raises CpuOpsUnavailable with the reason, each time it is asked; the build is tried once."""
    ops, reason = _build()
    if ops is None:
        raise CpuOpsUnavailable(reason)
    return ops


def cpu_ops_available(device: str | torch.device = "cpu", warn: bool = True) -> bool:
    """Whether the C++ operators can run on device (CPUs only). Where they cannot be built, warns with
    the reason (once per process) and returns False."""
    if torch.device(device).type != "cpu":
        return False
    ops, reason = _build()
    if ops is None and warn:
        _warn_once(reason)
    return ops is not None


def find_compiler() -> str | None:
    """The C++ compiler's path: $CXX where it names one on PATH, else the first of COMPILERS there;
    None where there is none, the one place a failed build is expected."""
    for name in (os.environ.get("CXX"), *COMPILERS):
        path = shutil.which(name) if name else None
        if path:
            return path
    return None


@functools.lru_cache(maxsize=None)
def _warn_once(reason: str) -> None:
    warnings.warn(f"{reason}. radarlab keeps its torch code for these operators.", stacklevel=3)


@functools.lru_cache(maxsize=None)
def _build():
    """(torch.ops.radarlab, None) or (None, why not), once per process: a process can register the
    radarlab namespace only once, and a failed build is not retried at every call."""
    from torch.utils import cpp_extension

    from radarlab.device import cpu_flags, cpu_kind
    from radarlab.util import cache_dir

    compiler = find_compiler()
    if compiler is None:
        return None, (f"could not build radarlab's C++ operators: no C++ compiler on PATH "
                      f"({', '.join(COMPILERS)}; or set CXX)")
    march = os.environ.get("RADARLAB_CPU_MARCH", "native")
    one_unit = os.environ.get("RADARLAB_CPU_OPS_ONE_UNIT") == "1"
    # the real CPU, never an override
    name = f"radarlab_cpu_ops_{march}_{cpu_kind(cpu_flags())}".replace("-", "_")
    name += "_one_unit" if one_unit else ""
    build = cache_dir() / "kernels" / name
    build.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(build / "lock")
    _ensure_ninja_on_path()
    # torch builds with $CXX, else c++: where neither exists, it is given the compiler found
    lend = os.environ.get("CXX") is None and shutil.which("c++") is None
    if lend:
        os.environ["CXX"] = compiler
    try:
        sources = [unity_source(build)] if one_unit else [CSRC / s for s in SOURCES]
        cpp_extension.load(name, [str(s) for s in sources], extra_cflags=[*CFLAGS, f"-march={march}"],
                           build_directory=str(build), is_python_module=False, verbose=False)
    except Exception as err:  # no ninja, no headers, a compile error: the reason is in the message
        used = os.environ.get("CXX") or compiler
        return None, (f"could not build radarlab's C++ operators ({', '.join(SOURCES)}) with {used}: "
                      f"{type(err).__name__}: {err}")
    finally:
        if lend:
            del os.environ["CXX"]
    return torch.ops.radarlab, None


def unity_source(build: Path) -> Path:
    """One file, in the build folder, that #includes every source: the torch headers, most of a build's
    work, are parsed once rather than once per source. For builds that are only checked, never timed
    (the tests' AVX2 and plain-loop builds): the engine's own build keeps a unit per file, as the
    one-unit library ran the engine slower side by side (not explained). Its first line hashes csrc/,
    so torch's JIT versioning sees an edit to any file there."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    text = "\n".join([f"// radarlab's C++ operators as one translation unit (radarlab/cpu_ops.py); "
                      f"csrc {digest.hexdigest()[:16]}", *(f'#include "{CSRC / s}"' for s in SOURCES)]) + "\n"
    path = build / "radarlab_ops.cpp"
    if not path.is_file() or path.read_text() != text:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # two processes may build at once
        tmp.write_text(text)
        tmp.replace(path)
    return path


# A build takes seconds to a minute or two; a lock older than this was left by a build that was killed.
STALE_LOCK_S = 600.0


def _clear_stale_lock(lock: Path, now: float | None = None, stale_after_s: float = STALE_LOCK_S) -> bool:
    """torch's build lock (a file) outlives a build that was killed (Ctrl-C, a killed kernel), and
    every later build then waits on it forever. Remove one older than any build; True if it did."""
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < stale_after_s:
        return False
    warnings.warn(f"removing {lock}: a C++ operator build left it {age / 60:.0f} minutes ago and was "
                  "stopped before it finished", stacklevel=2)
    lock.unlink(missing_ok=True)
    return True


def _ensure_ninja_on_path() -> None:
    """torch builds with ninja, looked up on PATH. The ninja wheel installs it into the venv's bin,
    which is not on PATH when a notebook kernel or a bare interpreter runs from the venv."""
    if shutil.which("ninja"):
        return
    venv_bin = Path(sys.executable).parent
    if (venv_bin / "ninja").exists():
        os.environ["PATH"] = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
