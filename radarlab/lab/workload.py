"""A synthetic serving workload: request lengths drawn from a heavy-tailed distribution, fixed seed.

Real chat traffic has many short requests and a long tail of long ones, and that tail is what a
max-length reservation pays for. We draw prompt and output lengths from log-normal distributions,
the usual fit for such right-skewed, positive lengths:

    length = round(exp(mu + sigma * Z)),  Z ~ N(0, 1),  mu = ln(mean) - sigma**2 / 2

so `mean` is the mean before clipping and sigma sets the tail (p99 / median = exp(2.33 sigma): about
10x at sigma 1.0, 6.4x at 0.8). The default means, 161 prompt and 338 output tokens, are the
ShareGPT averages the vLLM paper reports (Kwon et al. 2023, Fig. 11); the sigmas are our choice, a
tail long enough that some requests approach max_model_len. Lengths are then clipped so every
request fits the model: 1 <= prompt <= max_model_len - 1 and 1 <= output <= max_model_len - prompt.

All requests arrive at step 0 (an offline batch, as in vLLM's throughput benchmark), which keeps the
cache as full as the scheduler allows: the regime where memory decides concurrency.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from radarlab.util import is_int, require_int, require_number


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a synthetic workload: only its lengths matter."""

    request_id: int
    prompt_len: int
    output_len: int  # tokens to generate, the last one included

    @property
    def max_cached_tokens(self) -> int:
        """Positions the request fills at most: its last sampled token is never fed back, so its KV
        is never written (vLLM allocates slots only for tokens it computes)."""
        return self.prompt_len + self.output_len - 1


@dataclass(frozen=True)
class WorkloadSpec:
    """Parameters of the synthetic workload; the defaults are the benchmark's."""

    num_requests: int = 256
    seed: int = 0
    max_model_len: int = 2048  # the context vLLM runs the course model with here (its own limit is 8192)
    prompt_mean: float = 161.0
    prompt_sigma: float = 1.0
    output_mean: float = 338.0
    output_sigma: float = 0.8

    def __post_init__(self) -> None:
        require_int("num_requests", self.num_requests)
        require_int("seed", self.seed, 0)
        require_int("max_model_len", self.max_model_len, 2)  # room for a 1-token prompt and 1 output token
        for name in ("prompt_mean", "prompt_sigma", "output_mean", "output_sigma"):
            require_number(name, getattr(self, name), positive=True)

    def as_dict(self) -> dict:
        return asdict(self)


def lognormal_lengths(rng: np.random.Generator, n: int, mean: float, sigma: float) -> np.ndarray:
    """n integer lengths >= 1 from a log-normal with the given mean (before rounding) and shape sigma."""
    mu = math.log(mean) - sigma ** 2 / 2
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, size=n))).astype(np.int64)


def make_workload(spec: WorkloadSpec = WorkloadSpec()) -> list[WorkloadRequest]:
    """The requests of a spec, the same for the same spec on every machine (numpy's PCG64 generator)."""
    rng = np.random.default_rng(spec.seed)
    prompts = lognormal_lengths(rng, spec.num_requests, spec.prompt_mean, spec.prompt_sigma)
    outputs = lognormal_lengths(rng, spec.num_requests, spec.output_mean, spec.output_sigma)
    requests = []
    for i, (p, o) in enumerate(zip(prompts.tolist(), outputs.tolist())):
        p = min(p, spec.max_model_len - 1)
        o = min(o, spec.max_model_len - p)
        requests.append(WorkloadRequest(i, p, o))
    return requests


def length_summary(values: list[int]) -> dict:
    """min, mean, median, p90, p99 and max of a list of lengths (for the JSON and the notebook)."""
    arr = np.asarray(values)
    return {
        "min": int(arr.min()),
        "mean": round(float(arr.mean()), 2),
        "p50": round(float(np.percentile(arr, 50)), 2),
        "p90": round(float(np.percentile(arr, 90)), 2),
        "p99": round(float(np.percentile(arr, 99)), 2),
        "max": int(arr.max()),
    }


def random_token_prompts(num_prompts: int, vocab_size: int, len_range: tuple[int, int] = (16, 128),
                         seed: int = 0) -> list[list[int]]:
    """Prompts of random token ids, lengths uniform in len_range (inclusive), seeded. Random ids
    make every prompt distinct (no prefix-cache hits) and every system do the same work. The first
    k prompts of a call do not depend on num_prompts, so a smaller batch is a prefix of a larger one."""
    require_int("num_prompts", num_prompts)
    require_int("vocab_size", vocab_size)
    lo, hi = len_range
    if not (is_int(lo) and is_int(hi)) or not 1 <= lo <= hi:
        raise ValueError(f"len_range must be ints with 1 <= lo <= hi, got {len_range!r}")
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size,
                         size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(num_prompts)]


# Modules whose functions make the copy workload: plain Python, stable across 3.x releases.
COPY_SOURCE_MODULES = ("textwrap", "bisect", "heapq", "fnmatch", "shlex", "colorsys", "calendar", "glob",
                       "posixpath", "string", "tokenize", "difflib")
COPY_INSTRUCTION = ("Here is a Python function:\n```python\n{code}```\n"
                    "Repeat it exactly, unchanged:\n```python\n")
COPY_MAX_CHARS = 1200


def source_functions(modules: tuple[str, ...] = COPY_SOURCE_MODULES,
                     max_chars: int = COPY_MAX_CHARS) -> list[str]:
    """Top-level function definitions of standard-library modules, in module then file order, each
    at most max_chars long: text a speculative proposer can find again in the prompt."""
    import ast
    import importlib
    import inspect

    found = []
    for name in modules:
        source = inspect.getsource(importlib.import_module(name))
        lines = source.splitlines(keepends=True)
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef):
                text = "".join(lines[node.lineno - 1:node.end_lineno])
                if 200 <= len(text) <= max_chars:
                    found.append(text)
    return found


def copy_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """Copy-heavy prompts: a seeded choice of standard-library functions, each to be repeated. The
    first k prompts do not depend on num_prompts; with more prompts than functions they repeat."""
    require_int("num_prompts", num_prompts)
    functions = source_functions()
    order = np.random.default_rng(seed).permutation(len(functions)).tolist()
    return [COPY_INSTRUCTION.format(code=functions[order[i % len(order)]]) for i in range(num_prompts)]


FREE_TOPICS = ("a lighthouse keeper", "the history of bread", "how tides work", "a city at night",
               "learning to play the violin", "why the sky is blue", "a journey by train", "bees in winter",
               "the first computers", "a mountain village", "ocean currents", "an old library")
FREE_INSTRUCTIONS = ("Write a short story about {topic}.", "Explain {topic} to a child.",
                     "Write a poem about {topic}.", "Describe {topic} in a few paragraphs.")


def free_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """Free-generation prompts: seeded instruction x topic pairs, nothing to copy from."""
    require_int("num_prompts", num_prompts)
    rng = np.random.default_rng(seed)
    return [FREE_INSTRUCTIONS[int(rng.integers(len(FREE_INSTRUCTIONS)))].format(
        topic=FREE_TOPICS[int(rng.integers(len(FREE_TOPICS)))]) for _ in range(num_prompts)]
