"""The course model and our own forward pass."""
from radarlab.models.loader import COURSE_MODEL, ModelNotAvailable, course_model_dir, load_hf, resolve_model

__all__ = [
    "COURSE_MODEL",
    "ModelNotAvailable",
    "course_model_dir",
    "load_hf",
    "resolve_model",
]
