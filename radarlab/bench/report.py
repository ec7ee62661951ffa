"""How every benchmark's JSON is written, and the comma-separated list flags they share. Where it ran (environment()) lives in radarlab.lab.machine."""
from __future__ import annotations

import json
from pathlib import Path


def write_json(path: str | Path, payload: dict) -> Path:
    """Write payload as indented JSON, creating the parent folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def comma_ints(flag: str, text: str) -> tuple[int, ...]:
    """A flag like --batch-sizes 1,16,64; ValueError names the flag."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--{flag}: expected comma-separated integers, got {text!r}") from None


def comma_names(text: str) -> tuple[str, ...]:
    """A flag like --systems radarlab,vllm; blanks dropped."""
    return tuple(x.strip() for x in text.split(",") if x.strip())
