"""`python -m radarlab.validate [--json PATH] [--skip-vllm] [--sections hf,vllm,...]`: every check against
its reference, one table.

--json writes the rows (each with its details, e.g. the vLLM attention kernel and CPU kind of an op
row), the sections run and a "machine" entry: versions, device, CPU model, kind and flags. --sections
runs some of the table (e.g. `fp8`, whose vLLM side needs an x86 CPU with AVX-512 or AMX).

Exits non-zero if any check fails. Without a vLLM environment the vLLM rows fail (and say how to
install it) unless --skip-vllm is given.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from radarlab.validate.prompts import VALIDATION_PROMPTS
from radarlab.validate.table import Row, format_table

# The table's sections in order: transformers, then vLLM's plain, paged, FP8 and speculative rows.
SECTIONS = ("hf", "vllm", "paged", "fp8", "spec")


def parse_sections(text: str, skip_vllm: bool = False) -> tuple[str, ...]:
    """The sections named in a comma list, in table order; --skip-vllm means "hf" alone."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        raise ValueError(f"--sections takes a comma list of {', '.join(SECTIONS)}; got {text!r}")
    return ("hf",) if skip_vllm else tuple(s for s in SECTIONS if s in names)


def collect(sections: tuple[str, ...]) -> list[Row]:
    from radarlab.models.llama import Llama
    from radarlab.models.loader import load_hf
    from radarlab.validate import hf, vllm

    hf_model, tok = load_hf(None, dtype=torch.float32, attn_implementation="eager")
    model = Llama.from_hf(hf_model)
    prompts = [tok(p)["input_ids"] for p in VALIDATION_PROMPTS]
    rows = hf.rows(model, hf_model, prompts, tok.eos_token_id) if "hf" in sections else []
    if set(sections) == {"hf"}:
        return rows
    if vllm.vllm_python() is None:
        return rows + [Row("vLLM rows", "vLLM", "not run: no vLLM environment", "run `make vllm`", False)]
    from radarlab.validate import vllm_fp8, vllm_paged, vllm_spec

    run = {"vllm": lambda: vllm.rows(model, prompts),
           "paged": lambda: vllm_paged.rows(model, prompts, vllm_paged.prefix_workload(tok)),
           "fp8": lambda: vllm_fp8.rows(model, prompts),
           "spec": lambda: vllm_spec.rows(model, tok)}
    for section in sections:
        if section != "hf":
            rows += run[section]()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m radarlab.validate", description=__doc__)
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    parser.add_argument("--skip-vllm", action="store_true", help="only the transformers rows")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma list of the table's sections to run ({','.join(SECTIONS)})")
    args = parser.parse_args(argv)
    try:
        sections = parse_sections(args.sections, args.skip_vllm)
    except ValueError as exc:
        parser.error(str(exc))
    start = time.perf_counter()
    rows = collect(sections)
    print(format_table(rows))
    failed = sum(not r.passed for r in rows)
    print(f"{len(rows) - failed} passed, {failed} failed  ({time.perf_counter() - start:.0f} s)")
    if args.json:
        from radarlab.lab.machine import environment

        # The machine with the rows: which vLLM kernels ran (rows' details) depends on its CPU.
        with open(args.json, "w") as f:
            json.dump({"sections": list(sections), "rows": [r.as_dict() for r in rows], "passed": failed == 0,
                       "machine": environment()}, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
