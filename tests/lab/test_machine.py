"""radarlab.device (CPU flags and kind) and radarlab.lab.machine (vLLM attention ISAs) from /proc/cpuinfo
text.

The samples are trimmed /proc/cpuinfo of the three x86 kinds the course ran on (flags lines cut to
the ones around what matters, two processors each as the real file has) and one aarch64 machine.
No vLLM needed; the worker's own copy of the rules is checked against these too.
"""
from __future__ import annotations

import json

import pytest

from radarlab import device
from radarlab.device import (
    X86_FLAGS,
    cpu_arch,
    cpu_flags,
    cpu_kind,
    cpu_kinds,
    cpu_model,
    cpu_vendor,
    parse_cpuinfo,
)
from radarlab.lab.machine import ATTENTION_ISAS, attention_isas_supported, environment, isa_missing
from radarlab.validate import vllm_worker


def _two_processors(model: str, flags: str) -> str:
    vendor = "GenuineIntel" if model.startswith("Intel") else "AuthenticAMD"
    return "".join(f"processor\t: {i}\nvendor_id\t: {vendor}\nmodel name\t: {model}\nflags\t\t: {flags}\n"
                   f"bogomips\t: 4000.00\n\n" for i in range(2))


AVX2_ONLY = _two_processors(  # an AMD EPYC (Zen 2): AVX2, no AVX-512
    "AMD EPYC 7B12",
    "fpu vme sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c bmi1 avx2 smep bmi2 sha_ni clzero")
AVX512_BF16 = _two_processors(  # this course's AMD EPYC (Zen 4/5): AVX-512 with BF16, no AMX
    "AMD EPYC",
    "fpu sse sse2 fma avx f16c avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx_vnni avx512_bf16 "
    "avx512vbmi avx512_vnni avx512_bitalg avx512_vpopcntdq")
AMX = _two_processors(  # an Intel Xeon (Sapphire Rapids): AVX-512, BF16 and AMX
    "Intel(R) Xeon(R) Platinum 8480+", "fpu sse sse2 fma avx f16c avx2 avx512f avx512dq avx512cd avx512bw "
    "avx512vl avx512_bf16 avx512_fp16 avx512_vnni amx_bf16 amx_tile amx_int8 arch_lbr")
AARCH64 = ("processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes "
           "pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\nCPU "
           "implementer\t: 0x41\nCPU part\t: 0xd0c\n\n")

KINDS = [(AVX2_ONLY, "avx2", ["vec", "vec16"]),
         (AVX512_BF16, "avx512_bf16", ["vec", "vec16"]),
         (AMX, "avx512_bf16_amx", ["vec", "vec16", "amx"])]


@pytest.mark.parametrize("text, kind, isas", KINDS)
def test_three_x86_kinds(text, kind, isas):
    flags = cpu_flags(text)
    assert set(flags) == set(X86_FLAGS) and all(isinstance(v, bool) for v in flags.values())
    assert cpu_kind(flags, "x86_64") == kind
    assert attention_isas_supported(flags, "x86_64") == isas


def test_flags_are_read_word_by_word():
    """avx512_bf16 must not count as avx512f, nor amx_bf16 as amx_tile: whole words only."""
    flags = cpu_flags(AVX512_BF16)
    assert flags["avx2"] and flags["avx512f"] and flags["avx512_bf16"]
    assert not flags["amx_tile"] and not flags["amx_bf16"] and not flags["amx_int8"]
    only_bf16 = cpu_flags("flags\t: avx2 avx512_bf16 amx_bf16\n")
    assert only_bf16 == {"avx2": True, "avx512f": False, "avx512_bf16": True, "amx_tile": False,
                         "amx_bf16": True, "amx_int8": False}
    assert cpu_kind(only_bf16, "x86_64") == "avx2"  # bf16 and AMX words alone make no AVX-512 CPU


def test_model_name():
    assert cpu_model(AMX) == "Intel(R) Xeon(R) Platinum 8480+"
    assert cpu_model(AVX512_BF16) == "AMD EPYC"
    assert cpu_model(AARCH64) == "unknown"  # aarch64's cpuinfo has no model name line
    assert parse_cpuinfo("") == (None, frozenset())


def test_vendor():
    """The vendor picks radarlab's fp32 matmul path at a few rows (models/linear.py)."""
    assert cpu_vendor(AMX) == "GenuineIntel"
    assert cpu_vendor(AVX2_ONLY) == cpu_vendor(AVX512_BF16) == "AuthenticAMD"
    assert cpu_vendor(AARCH64) == cpu_vendor("") == "unknown"  # aarch64's cpuinfo has no vendor_id line
    assert cpu_vendor("vendor_id\t:\nvendor_id\t: GenuineIntel\n") == "unknown"  # the first line counts
    assert cpu_vendor() == environment()["cpu_vendor"] != ""
    with pytest.raises(TypeError, match="cpuinfo text must be a str"):
        cpu_vendor(b"vendor_id: GenuineIntel")


def test_aarch64_runs_neon_and_the_generic_kernels():
    flags = cpu_flags(AARCH64)
    assert not any(flags.values())
    assert parse_cpuinfo(AARCH64)[1] >= {"asimd", "fp"}
    assert cpu_kind(flags, "aarch64") == "aarch64"
    assert attention_isas_supported(flags, "arm64") == ["vec", "vec16", "neon"]


def test_missing_names_the_flag_or_the_architecture():
    assert isa_missing("amx", cpu_flags(AVX512_BF16), "x86_64") == ["amx_tile", "amx_bf16"]
    assert isa_missing("amx", cpu_flags(AVX2_ONLY), "x86_64") == ["avx512f", "avx512_bf16", "amx_tile",
                                                                  "amx_bf16"]
    assert isa_missing("amx", cpu_flags(AMX), "x86_64") == []
    assert isa_missing("neon", cpu_flags(AMX), "x86_64") == ["aarch64 (this CPU is x86_64)"]
    assert isa_missing("amx", cpu_flags(AARCH64), "aarch64") == ["x86_64 (this CPU is aarch64)"]
    assert isa_missing("vec", {f: False for f in X86_FLAGS}, "x86_64") == ["avx2"]
    with pytest.raises(ValueError, match="isa must be one of"):
        isa_missing("avx9000")
    with pytest.raises(TypeError, match="flags must be a dict"):
        cpu_kind(["avx2"], "x86_64")
    with pytest.raises(TypeError, match="cpuinfo text must be a str"):
        parse_cpuinfo(None)


def test_arch_names():
    assert cpu_arch("AMD64") == "x86_64" and cpu_arch("arm64") == "aarch64" and cpu_arch("x86_64") == "x86_64"
    assert cpu_arch("Sparc64") == "sparc64"


def test_without_proc_cpuinfo_torch_answers(monkeypatch):
    """Where there is no /proc/cpuinfo (macOS), torch's capability map stands in, avx512_f spelling
    included."""
    monkeypatch.setattr(device, "read_cpuinfo", lambda: None)
    monkeypatch.setattr(device, "_torch_capabilities",
                        lambda: {"avx2": True, "avx512_f": True, "avx512_bf16": False,
                                 "cpu_name": "Some CPU"})
    flags = cpu_flags()
    assert flags["avx2"] and flags["avx512f"] and not flags["avx512_bf16"] and not flags["amx_tile"]
    assert cpu_kind(flags, "x86_64") == "avx512"
    assert cpu_model() == "Some CPU"


@pytest.mark.parametrize("text, arch", [(AVX2_ONLY, "x86_64"), (AVX512_BF16, "x86_64"), (AMX, "x86_64"),
                                        (AARCH64, "aarch64")])
def test_worker_copy_agrees(text, arch):
    """vllm_worker cannot import radarlab, so it carries its own reader and ISA table: same answers."""
    flags = cpu_flags(text)
    assert vllm_worker._parse_cpu_flags(text) == flags
    assert list(vllm_worker.ATTENTION_ISAS) == list(ATTENTION_ISAS)
    for isa in ATTENTION_ISAS:
        assert vllm_worker.isa_missing(isa, flags, arch) == isa_missing(isa, flags, arch), isa
        rule, theirs = ATTENTION_ISAS[isa], vllm_worker.ATTENTION_ISAS[isa]
        assert (rule.dtypes, rule.block_multiple, rule.head_multiple) == (
            theirs["dtypes"], theirs["block_multiple"], theirs["head_multiple"]), isa


def test_this_machine():
    flags = cpu_flags()
    kind = cpu_kind(flags)
    isas = attention_isas_supported(flags)
    print(f"\n{cpu_model()}: {kind}, attention ISAs {isas}")
    if cpu_arch() == "x86_64" and flags["avx2"]:
        assert {"vec", "vec16"} <= set(isas)
    assert ("amx" in isas) == (kind == "avx512_bf16_amx")


def test_environment_names_the_cpu():
    env = environment()
    assert {"radarlab", "python", "torch", "device", "cpu_model", "cpu_kind", "cpu_flags",
            "attention_isas"} <= set(env)
    assert env["cpu_kind"] == cpu_kind() and env["cpu_flags"] == cpu_flags()
    json.dumps(env)  # goes into every benchmark's JSON as it is


def test_cpu_kinds_name_every_answer_of_cpu_kind():
    """Kept results are named after cpu_kinds(), and the notebooks' choice of one is tested for each: every
    flag combination on x86, and every architecture vLLM's CPU build knows, answers one of them."""
    from itertools import product

    answers = {cpu_kind(dict(zip(X86_FLAGS, bits)), "x86_64") for bits in product((False, True),
                                                                                  repeat=len(X86_FLAGS))}
    answers |= {cpu_kind({}, arch) for arch in ("aarch64", "arm64", "s390x", "ppc64le", "riscv64")}
    assert answers == set(cpu_kinds()) and len(cpu_kinds()) == len(set(cpu_kinds()))


def test_radarlab_cpu_kind_stands_in_for_this_machine_only(monkeypatch):
    """The override answers for this machine (what the notebooks ask), not for given flags, and never
    reaches the environment a run records."""
    real = cpu_kind()
    other = "avx2" if real != "avx2" else "avx512"
    monkeypatch.setenv("RADARLAB_CPU_KIND", other)
    assert cpu_kind() == other
    assert cpu_kind(cpu_flags(AMX), "x86_64") == "avx512_bf16_amx"
    assert cpu_kind(cpu_flags()) == real and environment()["cpu_kind"] == real
    monkeypatch.setenv("RADARLAB_CPU_KIND", "pentium")
    with pytest.raises(ValueError, match="RADARLAB_CPU_KIND must be one of .*'avx2'.*got 'pentium'"):
        cpu_kind()
    monkeypatch.setenv("RADARLAB_CPU_KIND", "")
    assert cpu_kind() == real
