"""Model configs for the KV calculator: the stored ones, local files and directories, and clear errors.
Nothing here reaches a model hub: hub lookups run with local_files_only or HF_HUB_OFFLINE=1."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from radarlab.kvcache.memory import GB, KVModelShape, kv_bytes_per_token, kv_footprint, shape_from_model
from radarlab.kvcache.model_config import load_model_config, stored_config, stored_config_names

# name: (layers, KV heads, head dim, fp16 KV bytes per token = layers x kv_heads x head_dim x 2 x 2)
KNOWN = {
    "llama-3.1-70b": (80, 8, 128, 327_680),
    "llama-3.1-8b": (32, 8, 128, 131_072),
    "mistral-7b-v0.1": (32, 8, 128, 131_072),
    "qwen2.5-7b": (28, 4, 128, 57_344),
    "smollm2-135m": (30, 3, 64, 23_040),
}


def test_every_stored_config_is_pinned():
    assert stored_config_names() == tuple(sorted(KNOWN))


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_stored_config_gives_the_known_kv_bytes(name):
    layers, kv_heads, head_dim, fp16_bytes = KNOWN[name]
    _, shape = shape_from_model(name)
    assert shape == KVModelShape(layers, kv_heads, head_dim)
    assert kv_bytes_per_token(layers, kv_heads, head_dim, kv_dtype="fp16") == fp16_bytes
    assert kv_bytes_per_token(layers, kv_heads, head_dim, kv_dtype="fp8") == fp16_bytes // 2


def test_llama_70b_is_the_articles_model():
    _, shape = shape_from_model("llama-3.1-70b")
    fp = kv_footprint(shape.layers, shape.kv_heads, shape.head_dim, tokens=32768)
    assert fp.bytes_per_stream == 327_680 * 32768 and f"{fp.bytes_per_stream / GB:.2f}" == "10.74"


def test_stored_configs_name_their_source_and_hold_only_sizing_fields():
    allowed = {"source", "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "hidden_size", "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings",
               "tie_word_embeddings"}  # tying decides the weights counted beside the KV cache
    for name in stored_config_names():
        config = stored_config(name)
        assert set(config) <= allowed, name
        assert config["source"].count("/") == 1, name  # an HF repo id: org/name
    assert stored_config("llama-3.1-70b")["hidden_size"] == 8192
    assert stored_config("llama-3.1-70b")["num_attention_heads"] == 64


def test_head_dim_is_derived_when_the_config_omits_it():
    config = stored_config("qwen2.5-7b")
    assert "head_dim" not in config and config["hidden_size"] // config["num_attention_heads"] == 128
    assert shape_from_model("qwen2.5-7b")[1].head_dim == 128


def test_stored_names_ignore_case_and_accept_the_repo_id():
    assert shape_from_model("Llama-3.1-70B")[1] == shape_from_model("meta-llama/Llama-3.1-70B")[1]
    name, _ = shape_from_model("Qwen/Qwen2.5-7B")
    assert name == "qwen2.5-7b (Qwen/Qwen2.5-7B, stored in radarlab)"


def test_course_model_config_matches_the_stored_smollm2():
    """The converted course model (made by `make model`) against the stored SmolLM2 numbers."""
    from radarlab.models.loader import course_model_dir

    try:
        path = course_model_dir(convert=False)
    except Exception as err:
        pytest.skip(str(err))
    local = json.loads((path / "config.json").read_text())
    for key, value in stored_config("smollm2-135m").items():
        if key != "source":
            assert local[key] == value, key


def test_local_directory_and_file(tmp_path):
    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    name, shape = shape_from_model(str(tmp_path))
    assert name == str(tmp_path) and shape == KVModelShape(4, 2, 32)
    assert shape_from_model(str(tmp_path / "config.json"))[1] == KVModelShape(4, 2, 32)
    config["head_dim"] = 64  # a published head_dim wins over hidden_size / heads
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert shape_from_model(str(tmp_path))[1] == KVModelShape(4, 2, 64)


@pytest.mark.parametrize("content, message", [
    ("{not json", "cannot read .* as JSON"),
    ("[1, 2]", ".*config.json holds a JSON list, not an object"),
    ('{"num_attention_heads": 8}', "config has no num_hidden_layers"),
])
def test_bad_config_files_say_what_is_wrong(tmp_path, content, message):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match=f"^model '{tmp_path}': {message}"):
        shape_from_model(str(tmp_path))


def test_missing_paths_and_unknown_ids_error_clearly(tmp_path):
    with pytest.raises(ValueError, match="the directory has no config.json"):
        load_model_config(str(tmp_path))
    with pytest.raises(ValueError, match="no such file or directory .*stored configs: llama-3.1-70b"):
        load_model_config(str(tmp_path / "missing" / "config.json"))
    with pytest.raises(ValueError, match="model must be a config path"):
        load_model_config("")
    # a hub id that is not stored: offline, the hub cannot answer, and the error says what to do instead
    with pytest.raises(ValueError, match="no-such-org/no-such-model.*hub gave no config.*Offline\\?"):
        load_model_config("no-such-org/no-such-model", local_files_only=True)


def test_cli_model_flag(capsys):
    from radarlab.kvcache import memory

    assert memory.main(["--model", "llama-3.1-70b", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"].startswith("llama-3.1-70b") and out["bytes_per_token"] == 327_680
    assert memory.main(["--model", "smollm2-135m", "--tokens", "8192"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("model: smollm2-135m (HuggingFaceTB/SmolLM2-135M") and "23,040" in text


@pytest.mark.parametrize("args, message", [
    (["--model", "llama-3.1-8b", "--layers", "4"], "give --model or those flags, not both (got --layers)"),
    (["--model", "qwen2.5-7b", "--kv-heads", "2", "--head-dim", "64"], "(got --kv-heads, --head-dim)"),
    (["--model", "./no/such/dir"], "--model './no/such/dir': no such file or directory"),
])
def test_cli_model_errors(args, message, capsys):
    from radarlab.kvcache import memory

    with pytest.raises(SystemExit) as exc:
        memory.main(args)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_cli_help_lists_the_stored_names():
    from radarlab.kvcache.memory import build_parser

    text = build_parser().format_help()
    assert all(name in text.replace("\n", " ") for name in stored_config_names())


def test_cli_unknown_hub_id_offline():
    """The real command with the hub switched off: exit status 2, a message, no traceback."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "radarlab.kvcache.memory", "--model",
                          "no-such-org/no-such-model"],
                         capture_output=True, text=True, env=env)
    assert run.returncode == 2
    assert "--model 'no-such-org/no-such-model'" in run.stderr and "Traceback" not in run.stderr
