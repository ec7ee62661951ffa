"""How every benchmark's JSON is written. Where it ran (environment()) lives in radarlab.hardware.machine."""
from __future__ import annotations

import json
from pathlib import Path


def write_json(path: str | Path, payload: dict) -> Path:
    """Write payload as indented JSON, creating the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path
