"""What every benchmark's JSON carries besides its results: where it ran, and how it is written."""
from __future__ import annotations

import json
import platform
import sys
from pathlib import Path


def environment() -> dict:
    """Versions and the device, so a figure can be traced to the machine that produced it."""
    import numpy
    import torch

    import radarlab
    from radarlab.device import device_info

    info = device_info()
    return {
        "radarlab": radarlab.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "device": info.device,
        "device_name": info.name,
        "full_scale": info.full_scale,
    }


def write_json(path: str | Path, payload: dict) -> Path:
    """Write payload as indented JSON, creating the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path
