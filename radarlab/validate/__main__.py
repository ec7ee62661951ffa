"""`python -m radarlab.validate [--json PATH] [--skip-vllm]`: every check against its reference, one table.

--json writes the rows (each with its details, e.g. the vLLM attention kernel and CPU kind of an op
row) and a "machine" entry: versions, device, CPU model, kind and flags.

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


def collect(skip_vllm: bool) -> list[Row]:
    from radarlab.models.llama import Llama
    from radarlab.models.loader import load_hf
    from radarlab.validate import hf, vllm

    hf_model, tok = load_hf(None, dtype=torch.float32, attn_implementation="eager")
    model = Llama.from_hf(hf_model)
    prompts = [tok(p)["input_ids"] for p in VALIDATION_PROMPTS]
    rows = hf.rows(model, hf_model, prompts, tok.eos_token_id)
    if skip_vllm:
        return rows
    if vllm.vllm_python() is None:
        return rows + [Row("vLLM rows", "vLLM", "not run: no vLLM environment", "run `make vllm`", False)]
    from radarlab.validate import vllm_fp8, vllm_paged, vllm_spec

    return (rows + vllm.rows(model, prompts) + vllm_paged.rows(model, prompts,
                                                               vllm_paged.prefix_workload(tok))
            + vllm_fp8.rows(model, prompts) + vllm_spec.rows(model, tok))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m radarlab.validate", description=__doc__)
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON")
    parser.add_argument("--skip-vllm", action="store_true", help="only the transformers rows")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    rows = collect(args.skip_vllm)
    print(format_table(rows))
    failed = sum(not r.passed for r in rows)
    print(f"{len(rows) - failed} passed, {failed} failed  ({time.perf_counter() - start:.0f} s)")
    if args.json:
        from radarlab.lab.machine import environment

        # The machine with the rows: which vLLM kernels ran (rows' details) depends on its CPU.
        with open(args.json, "w") as f:
            json.dump({"rows": [r.as_dict() for r in rows], "passed": failed == 0, "machine": environment()},
                      f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
