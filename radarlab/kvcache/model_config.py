"""Where the KV calculator's model numbers come from: a Hugging Face config.json.

`--model` may name a directory holding config.json, a config.json file, a hub id (read with transformers'
AutoConfig, so it needs the network or the local HF cache), or one of the configs stored in configs/ so
that the course runs offline. A stored file keeps only the fields that size a model, copied from the
published config.json of the repo its "source" names; that repo id finds the stored file too, so
`meta-llama/Llama-3.1-70B` works without network or a gated-repo token.
This module only finds the config; memory.shape_from_hf_config reads the three numbers from it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class FoundConfig:
    """A config and a name for reports: the stored name with its repo id, the path, or the hub id."""

    name: str
    config: object  # a config.json dict, or a transformers PretrainedConfig from the hub


@lru_cache(maxsize=None)
def stored_configs() -> dict[str, dict]:
    """{short name: config dict} for every file in configs/ (package data), sorted by name."""
    folder = resources.files(__package__).joinpath("configs")
    found = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            found[entry.name[: -len(".json")]] = json.loads(entry.read_text(encoding="utf-8"))
    return found


def stored_config_names() -> tuple[str, ...]:
    """The short names --model accepts without network (e.g. llama-3.1-70b)."""
    return tuple(stored_configs())


def stored_name(name: str) -> str | None:
    """The short name of the stored config that `name` means (its short name or its source repo id,
    any case), or None."""
    key = name.strip().lower()
    return next((short for short, config in stored_configs().items()
                 if key in (short, config["source"].lower())), None)


def stored_config(name: str) -> dict:
    """A stored config (a copy) by short name or source repo id."""
    short = stored_name(name)
    if short is None:
        raise ValueError(f"model {name!r} is not a stored config; stored: {', '.join(stored_config_names())}")
    return dict(stored_configs()[short])


def _read_config_file(path: Path, model: str) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"model {model!r}: cannot read {path} as JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"model {model!r}: {path} holds a JSON {type(config).__name__}, not an object")
    return config


def _looks_like_path(model: str) -> bool:
    """A hub id is `name` or `org/name`; anything else that does not exist was meant as a path."""
    return (model.startswith(("/", ".", "~")) or model.endswith(".json") or model.count("/") > 1
            or "\\" in model)


def load_model_config(model: str, local_files_only: bool = False) -> FoundConfig:
    """The config `model` names, looked for in this order: a local directory or file, a stored config,
    the hub. Every failure is a ValueError starting with "model" and saying what was tried."""
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"model must be a config path, hub id or stored name, got {model!r}")
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / CONFIG_FILE).is_file():
            raise ValueError(f"model {model!r}: the directory has no {CONFIG_FILE}")
        return FoundConfig(str(path), _read_config_file(path / CONFIG_FILE, model))
    if path.is_file():
        return FoundConfig(str(path), _read_config_file(path, model))
    short = stored_name(model)
    if short is not None:
        config = stored_config(short)
        return FoundConfig(f"{short} ({config['source']}, stored in radarlab)", config)
    stored = ", ".join(stored_config_names())
    if _looks_like_path(model):
        raise ValueError(f"model {model!r}: no such file or directory (stored configs: {stored})")
    return FoundConfig(model, _from_hub(model, local_files_only, stored))


def _from_hub(model: str, local_files_only: bool, stored: str):
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ValueError(f"model {model!r} is not a local path or a stored config ({stored}); "
                         "reading a hub id needs transformers") from None
    try:
        return AutoConfig.from_pretrained(model, local_files_only=local_files_only)
    except Exception as err:  # offline, unknown id, gated repo: all mean the same thing here
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ValueError(f"model {model!r}: not a local path or a stored config ({stored}), and the Hugging "
                         f"Face hub gave no config for it ({reason}). Offline? Pass a directory containing "
                         f"{CONFIG_FILE}, a {CONFIG_FILE} file, or a stored name.") from None
