"""Where kernels run: CUDA when present, else the CPU with Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported, so import this module (radarlab's
__init__ does) before anything that imports triton.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass


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
