"""The machine a figure came from: its CPU's vector and matrix instructions, which of vLLM's CPU
attention kernels it can run, and the versions behind every benchmark's "environment" entry.

Why it matters here: vLLM's CPU build picks its attention kernel (its "ISA": vec, vec16, amx, ...)
from the CPU, and the same test can pass on one CPU and die on another. An AMD EPYC with AVX-512 and
AVX512-BF16 runs "vec"; an Intel Xeon with AMX runs "amx" for bf16, which Linux allows only after the
process asks for AMX tile state. So every comparison with vLLM records the CPU kind it ran on.

The CPU's flags and kind are radarlab.device's (the C++ operators' build is chosen by them too).

radarlab/validate/vllm_worker.py keeps its own few-line copy of the flag reader and of
ATTENTION_ISAS, because it runs in vLLM's environment, where radarlab is not installed;
tests/lab/test_machine.py holds the two copies to the same answers.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass

from radarlab.device import cpu_arch, cpu_flags, cpu_kind, cpu_model, cpu_vendor, flags_and_arch


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


def isa_missing(isa: str, flags: dict[str, bool] | None = None, arch: str | None = None) -> list[str]:
    """What this CPU lacks to run vLLM's attention kernel `isa`: the missing x86 flags, or the
    architecture for another architecture's kernel. Empty when it can run it."""
    if isa not in ATTENTION_ISAS:
        raise ValueError(f"isa must be one of {list(ATTENTION_ISAS)}, got {isa!r}")
    flags, arch = flags_and_arch(flags, arch)
    rule = ATTENTION_ISAS[isa]
    if rule.arch is not None and rule.arch != arch:
        return [f"{rule.arch} (this CPU is {arch})"]
    if arch != "x86_64":
        return []
    return [f for f in rule.x86_flags if not flags.get(f, False)]


def attention_isas_supported(flags: dict[str, bool] | None = None, arch: str | None = None) -> list[str]:
    """The vLLM CPU attention kernels this CPU can run, in ATTENTION_ISAS order."""
    flags, arch = flags_and_arch(flags, arch)
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
        "cpu_vendor": cpu_vendor(),
        "cpu_arch": cpu_arch(),
        "cpu_kind": cpu_kind(flags),
        "cpu_flags": flags,
        "attention_isas": attention_isas_supported(flags),
    }
