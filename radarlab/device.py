"""Where kernels run: CUDA when present, else the CPU with Triton's interpreter; and which CPU.

The CPU's kind (its vector and matrix instructions) picks the build of radarlab's C++ operators,
and vLLM's CPU build picks its library and attention kernel from it too, so the same test can pass
on one CPU and fail on another: every benchmark and validation records the kind it ran on. The
flags come from /proc/cpuinfo on Linux (what the kernel lets programs use), elsewhere from torch's
CPU capability map; the parsers take the text as an argument, so other machines' cpuinfo can be
tested here.

TRITON_INTERPRET must be set before triton is first imported, so import this module (radarlab's
__init__ does) before anything that imports triton.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False
    return torch.cuda.is_available()


def configure_triton() -> bool:
    """Set TRITON_INTERPRET=1 when there is no GPU. Returns True when kernels will be interpreted."""
    if _cuda_available():
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ["TRITON_INTERPRET"] == "1"


@dataclass(frozen=True)
class DeviceInfo:
    device: str
    name: str
    triton_mode: str  # "compiled" or "interpreted"
    full_scale: bool  # run the large versions of experiments


def full_scale() -> bool:
    """The single switch that scales notebook experiments up: on with a GPU, or RADARLAB_FULL=1."""
    flag = os.environ.get("RADARLAB_FULL")
    if flag is not None:
        return flag == "1"
    return _cuda_available()


def device_info() -> DeviceInfo:
    import torch

    interpreted = configure_triton()
    if torch.cuda.is_available():
        dev, name = "cuda", torch.cuda.get_device_name(0)
    else:
        dev, name = "cpu", platform.processor() or platform.machine()
    return DeviceInfo(dev, name, "interpreted" if interpreted else "compiled", full_scale())


def default_device() -> str:
    return "cuda" if _cuda_available() else "cpu"


# --- which CPU ---------------------------------------------------------------------------------
CPUINFO = Path("/proc/cpuinfo")

# The x86 flags that decide which vLLM build and attention kernel run, under /proc/cpuinfo's names.
# avx2: the least vLLM's x86 build needs (_C_AVX2); avx512f: _C_AVX512; avx512_bf16: _C, the build
# with the AMX kernels; amx_*: Intel's matrix tiles (amx_bf16 is the tile instruction vLLM's bf16
# attention uses).
X86_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
# torch's capability map spells one of them differently.
_TORCH_NAMES = {"avx512f": "avx512_f"}
# platform.machine() spellings of the architectures vLLM's CPU build supports.
_ARCH_ALIASES = {"amd64": "x86_64", "x86_64": "x86_64", "arm64": "aarch64", "aarch64": "aarch64",
                 "s390x": "s390x", "ppc64le": "ppc64le", "riscv64": "riscv64"}


def read_cpuinfo() -> str | None:
    """/proc/cpuinfo's text, or None where there is none (macOS, Windows)."""
    try:
        return CPUINFO.read_text(errors="replace")
    except OSError:
        return None


def parse_cpuinfo(text: str) -> tuple[str | None, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo text: the first processor's "model name" and "flags"
    (x86) or "Features" (aarch64) line. Every core of one machine lists the same flags."""
    model, flags = _first_value(text, ("model name",)), _first_value(text, ("flags", "features"))
    return model, frozenset(flags.split()) if flags else frozenset()


def _first_value(text: str, keys: tuple[str, ...]) -> str | None:
    """The value of the first "key : value" line of cpuinfo text whose key is one of keys, or None."""
    if not isinstance(text, str):
        raise TypeError(f"cpuinfo text must be a str, got {type(text).__name__}")
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in keys:
            return value.strip() or None
    return None


def _torch_capabilities() -> dict:
    import torch

    return dict(torch._C._cpu._get_cpu_capability())


def cpu_arch(machine: str | None = None) -> str:
    """The architecture as vLLM's platform code names it ("x86_64", "aarch64", ...); an unknown one
    comes back lower-cased as given."""
    machine = platform.machine() if machine is None else machine
    return _ARCH_ALIASES.get(machine.lower(), machine.lower())


def cpu_flags(cpuinfo: str | None = None) -> dict[str, bool]:
    """Each of X86_FLAGS -> whether this CPU has it. From cpuinfo text if given, else /proc/cpuinfo,
    else (no such file) torch's capability map. All False on a CPU that is not x86."""
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    if text is not None:
        _, flags = parse_cpuinfo(text)
        return {f: f in flags for f in X86_FLAGS}
    caps = _torch_capabilities()
    return {f: bool(caps.get(_TORCH_NAMES.get(f, f), False)) for f in X86_FLAGS}


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name ("AMD EPYC", "Intel(R) Xeon(R) Platinum 8480+"), as well as it can be told."""
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    model = parse_cpuinfo(text)[0] if text is not None else None
    if model is None and cpuinfo is None:
        model = _torch_capabilities().get("cpu_name") or platform.processor() or None
    return model or "unknown"


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The x86 vendor string ("GenuineIntel", "AuthenticAMD"), from cpuinfo text if given, else
    /proc/cpuinfo; "unknown" where there is none. Intel's MKL, which torch's fp32 F.linear calls,
    picks its kernels by vendor, so radarlab's choice of matmul path needs it (models/linear.py)."""
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    return (_first_value(text, ("vendor_id",)) if text is not None else None) or "unknown"


def flags_and_arch(flags: dict[str, bool] | None, arch: str | None) -> tuple[dict[str, bool], str]:
    """The flags and architecture given, or this CPU's where None (so callers can ask about other CPUs)."""
    flags = cpu_flags() if flags is None else flags
    if not isinstance(flags, dict):
        raise TypeError(f"flags must be a dict of flag -> bool, got {type(flags).__name__}")
    return flags, cpu_arch() if arch is None else cpu_arch(arch)


def cpu_kinds() -> tuple[str, ...]:
    """Every kind cpu_kind() names on the architectures vLLM's CPU build supports: x86's from the least
    to the most instructions, then the other architectures. Kept results are named after these
    (results/throughput-KIND.json), and tests run each notebook's choice of a kept run for each one."""
    return ("x86_64", "avx2", "avx512", "avx512_bf16", "avx512_bf16_amx",
            *sorted(set(_ARCH_ALIASES.values()) - {"x86_64"}))


def cpu_kind(flags: dict[str, bool] | None = None, arch: str | None = None) -> str:
    """One word for the CPU's class, as far as vLLM's CPU kernels care: "avx2", "avx512",
    "avx512_bf16", "avx512_bf16_amx" on x86 ("x86_64" below AVX2), the architecture elsewhere.

    Asked about this machine (no flags, no arch), it answers $RADARLAB_CPU_KIND where that is set to
    one of cpu_kinds(): a way to see what the notebooks show on another kind of CPU, since they pick
    their kept runs by kind. environment() and the C++ build pass the real flags, so the JSON a run
    writes and the compiled code stay this machine's."""
    if flags is None and arch is None and os.environ.get("RADARLAB_CPU_KIND"):
        forced = os.environ["RADARLAB_CPU_KIND"]
        if forced not in cpu_kinds():
            raise ValueError(f"RADARLAB_CPU_KIND must be one of {list(cpu_kinds())}, got {forced!r}")
        return forced
    flags, arch = flags_and_arch(flags, arch)
    if arch != "x86_64":
        return arch
    has = lambda *names: all(flags.get(n, False) for n in names)  # noqa: E731
    if has("avx512f", "avx512_bf16", "amx_tile", "amx_bf16"):
        return "avx512_bf16_amx"
    if has("avx512f", "avx512_bf16"):
        return "avx512_bf16"
    if has("avx512f"):
        return "avx512"
    if has("avx2"):
        return "avx2"
    return "x86_64"
