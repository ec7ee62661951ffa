"""How every benchmark's JSON is written, and the command-line flags they share. Where it ran
(environment()) lives in radarlab.lab.machine; how the notebooks find the kept runs, in
radarlab.lab.kept_runs."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from radarlab.util import require_int

# The two ways a benchmark runs vLLM, by system name, and each one's enforce_eager: `vllm` as users run
# it (default mode: the model compiled by torch.compile), `vllm_eager` with compilation off.
VLLM_EAGER = {"vllm": False, "vllm_eager": True}


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


def add_sweep_arguments(parser: argparse.ArgumentParser, config) -> None:
    """The flags of the sweeps over batch sizes and systems (throughput, spec), defaults the config's."""
    parser.add_argument("--batch-sizes", default=",".join(map(str, config.batch_sizes)), help="(%(default)s)")
    parser.add_argument("--systems", default=",".join(config.systems),
                        help="(%(default)s); vllm needs `make vllm`")
    parser.add_argument("--max-tokens", type=int, default=config.max_tokens,
                        help="new tokens per request (%(default)s)")
    parser.add_argument("--seed", type=int, default=config.seed, help="prompt seed (%(default)s)")
    parser.add_argument("--repeats", type=int, default=config.repeats,
                        help="runs per cell, every system alike; the fastest counts (%(default)s)")


def add_batching_arguments(parser: argparse.ArgumentParser, config) -> None:
    """The engine's batching flags, alike in every bench that runs it, defaults the config's;
    --max-num-seqs only where the config has that field (throughput runs each batch whole)."""
    parser.add_argument("--block-size", type=int, default=config.block_size,
                        help="tokens per KV block (%(default)s)")
    if hasattr(config, "max_num_seqs"):
        parser.add_argument("--max-num-seqs", type=int, default=config.max_num_seqs,
                            help="requests running at once, at most (%(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=config.max_num_batched_tokens,
                        help="tokens computed per step, at most (%(default)s)")


def require_sweep(config, ints: tuple[str, ...], ordered: tuple[str, str], choices: dict[str, tuple]) -> None:
    """What every sweep's config checks, each error naming its field: the `ints` fields are positive
    integers, `seed` is at least 0, the `ordered` pair is not reversed, `batch_sizes` is a non-empty list
    of positive integers, and each field of `choices` holds distinct values from its allowed ones."""
    for name in ints:
        require_int(name, getattr(config, name))
    require_int("seed", config.seed, minimum=0)
    lo, hi = ordered
    if getattr(config, lo) > getattr(config, hi):
        raise ValueError(f"{lo} ({getattr(config, lo)}) is above {hi} ({getattr(config, hi)})")
    if not config.batch_sizes:
        raise ValueError("batch_sizes is empty")
    for b in config.batch_sizes:
        require_int("batch_sizes", b)
    for name, allowed in choices.items():
        values = getattr(config, name)
        if not values:
            raise ValueError(f"{name} is empty")
        if any(v not in allowed for v in values) or len(set(values)) != len(values):
            raise ValueError(f"{name} must be distinct values from {list(allowed)}, got {list(values)}")


def require_vllm(systems, others: str) -> None:
    """Refuse a run whose --systems includes vllm where there is no vLLM environment, before any
    model loads; `others` is the --systems value that runs without it."""
    if "vllm" not in systems:
        return
    from radarlab.validate.vllm import vllm_python

    if vllm_python() is None:
        raise ValueError("--systems includes vllm but there is no vLLM environment: run `make vllm`, set "
                         f"RADARLAB_VLLM_PYTHON, or pass --systems {others}")


def vllm_modes(doc: dict) -> list[str]:
    """How each vLLM system of a benchmark's run ran: compiled, with its start-up (which holds the
    compilation, excluded from tokens/s; by method where each method had its own engine), or eager.
    A run without a recorded compilation ran eager: the benchmarks recorded it when they began to
    run vLLM's default mode."""
    env, lines = doc["environment"], []
    for system in VLLM_EAGER:
        if not any(r["system"] == system for r in doc["results"]):
            continue
        comp = env.get(f"{system}_compilation") or {"enforce_eager": True}
        start = env.get(f"{system}_init_s")
        if isinstance(start, dict):
            start_up = ", start-up " + ", ".join(f"{name} {s:.0f} s" for name, s in start.items())
        else:
            start_up = "" if start is None else f", start-up {start:.0f} s"
        if comp["enforce_eager"]:
            lines.append(f"{system}: eager (enforce_eager=True){start_up}")
        else:
            lines.append(f"{system}: compiled (mode {comp.get('mode')}, backend {comp.get('backend')})"
                         f"{start_up}, not counted in tokens/s")
    return lines
