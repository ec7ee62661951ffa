"""The machine a figure came from: its CPU's vector and matrix instructions, which of vLLM's CPU
attention kernels it can run, and the versions behind every benchmark's "environment" entry.

Why it matters here: vLLM's CPU build picks its attention kernel (its "ISA": vec, vec16, amx, ...)
from the CPU, and the same test can pass on one CPU and die on another. An AMD EPYC with AVX-512 and
AVX512-BF16 runs "vec"; an Intel Xeon with AMX runs "amx" for bf16, which Linux allows only after the
process asks for AMX tile state. So every comparison with vLLM records the CPU kind it ran on.

The flags come from /proc/cpuinfo on Linux (what the kernel lets programs use); elsewhere from
torch's CPU capability map (what the CPU reports). The parsers take the text as an argument, so they
can be tested on other machines' cpuinfo.

radarlab/validate/vllm_worker.py keeps its own few-line copy of the flag reader and of
ATTENTION_ISAS, because it runs in vLLM's environment, where radarlab is not installed;
tests/test_machine.py holds the two copies to the same answers.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

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


@dataclass(frozen=True)
class IsaRule:
    """What one of vLLM's CPU attention kernels needs (vLLM 0.32: cpu_attn.py's _get_attn_isa and the
    C++ kernels it dispatches to). None: not known here; vLLM checks it."""

    arch: str | None  # the only architecture vLLM builds it for; None: every one
    x86_flags: tuple[str, ...]  # flags needed on x86_64
    dtypes: tuple[str, ...] | None  # query/KV dtypes it takes
    block_multiple: int | None  # block_size must be a multiple of this
    head_multiple: int | None  # head_dim must be a multiple of this


ALL_DTYPES = ("float32", "bfloat16", "float16")
# "vec" and "vec16" are plain vector code, built into every vLLM CPU library (on x86 the least of them
# is the AVX2 one); "vec" works on 32-token groups, "vec16" on 16 (_get_attn_isa picks vec16 for block
# sizes or head sizes that are multiples of 16 only). "amx" is built into the _C library only, loaded on
# CPUs with AVX512-BF16, and its tile code exists for bf16 only (_get_attn_isa picks it for bf16 with
# block_size % 32 == 0 when torch sees amx_tile). The others are the kernels of other architectures.
ATTENTION_ISAS = {
    "vec": IsaRule(None, ("avx2",), ALL_DTYPES, 32, 32),
    "vec16": IsaRule(None, ("avx2",), ALL_DTYPES, 16, 16),
    "amx": IsaRule("x86_64", ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16"), ("bfloat16",), 32, 32),
    "neon": IsaRule("aarch64", (), None, None, None),
    "vxe": IsaRule("s390x", (), None, None, None),
    "vsx": IsaRule("ppc64le", (), None, None, None),
    "rvv": IsaRule("riscv64", (), None, None, None),
}


def read_cpuinfo() -> str | None:
    """/proc/cpuinfo's text, or None where there is none (macOS, Windows)."""
    try:
        return CPUINFO.read_text(errors="replace")
    except OSError:
        return None


def parse_cpuinfo(text: str) -> tuple[str | None, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo text: the first processor's "model name" and "flags"
    (x86) or "Features" (aarch64) line. Every core of one machine lists the same flags."""
    if not isinstance(text, str):
        raise TypeError(f"cpuinfo text must be a str, got {type(text).__name__}")
    model, flags = None, None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        if key == "model name" and model is None:
            model = value.strip() or None
        elif key in ("flags", "features") and flags is None:
            flags = frozenset(value.split())
    return model, flags or frozenset()


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


def _flags_and_arch(flags: dict[str, bool] | None, arch: str | None) -> tuple[dict[str, bool], str]:
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
    flags, arch = _flags_and_arch(flags, arch)
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


def isa_missing(isa: str, flags: dict[str, bool] | None = None, arch: str | None = None) -> list[str]:
    """What this CPU lacks to run vLLM's attention kernel `isa`: the missing x86 flags, or the
    architecture for another architecture's kernel. Empty when it can run it."""
    if isa not in ATTENTION_ISAS:
        raise ValueError(f"isa must be one of {list(ATTENTION_ISAS)}, got {isa!r}")
    flags, arch = _flags_and_arch(flags, arch)
    rule = ATTENTION_ISAS[isa]
    if rule.arch is not None and rule.arch != arch:
        return [f"{rule.arch} (this CPU is {arch})"]
    if arch != "x86_64":
        return []
    return [f for f in rule.x86_flags if not flags.get(f, False)]


def attention_isas_supported(flags: dict[str, bool] | None = None, arch: str | None = None) -> list[str]:
    """The vLLM CPU attention kernels this CPU can run, in ATTENTION_ISAS order."""
    flags, arch = _flags_and_arch(flags, arch)
    return [isa for isa in ATTENTION_ISAS if not isa_missing(isa, flags, arch)]


def environment() -> dict:
    """Versions, the device and the CPU, so a figure can be traced to the machine that produced it."""
    import numpy
    import torch

    import radarlab
    from radarlab.device import device_info

    info = device_info()
    flags = cpu_flags()
    return {
        "radarlab": radarlab.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "device": info.device,
        "device_name": info.name,
        "full_scale": info.full_scale,
        "cpu_model": cpu_model(),
        "cpu_arch": cpu_arch(),
        "cpu_kind": cpu_kind(flags),
        "cpu_flags": flags,
        "attention_isas": attention_isas_supported(flags),
    }
