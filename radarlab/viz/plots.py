"""Figure helpers shared by the notebooks."""
from __future__ import annotations

import os
from pathlib import Path

IMAGES_ENV = "RADARLAB_SAVE_FIGURES"


def images_dir() -> Path:
    """The repository's images/ folder (RADARLAB_IMAGES overrides)."""
    override = os.environ.get("RADARLAB_IMAGES")
    return Path(override) if override else Path(__file__).resolve().parents[2] / "images"


def save_figure(fig, name: str) -> Path | None:
    """Save fig as images/<name>.png, but only under `make figures` (RADARLAB_SAVE_FIGURES=1), so that
    test runs leave the tree clean. Returns the path written, or None."""
    if os.environ.get(IMAGES_ENV) != "1":
        return None
    if not name or "/" in name or name.endswith(".png"):
        raise ValueError(f"figure name must be a bare stem like 'decode_vs_batch', got {name!r}")
    path = images_dir() / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path
