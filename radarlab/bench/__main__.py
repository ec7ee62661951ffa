"""`python -m radarlab.bench SUBCOMMAND [options] [--json PATH]`: measure a goal, print a table, write JSON.

Subcommands:
  memory       reserved vs live KV memory, contiguous vs paged cache, on a synthetic workload
  throughput   output tokens/s of the radarlab engine, transformers and vLLM on the same prompts
  latency      TTFT, inter-token latency and throughput under Poisson arrivals, swept over request rates
  quant        KV-cache formats: bytes per token, attention error, perplexity through the paged cache,
               and how many long requests the engine runs at once on a fixed KV byte budget
  spec         tokens/s with and without speculative decoding (n-gram, trained EAGLE head), radarlab and vLLM
  profile      where the engine's decode step goes (matmuls, attention, casts, Python), per dtype and batch
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from radarlab.bench import kv_quant, latency, profile, reservation, speculation, throughput

    parser = argparse.ArgumentParser(prog="python -m radarlab.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="SUBCOMMAND", required=True)
    # Each benchmark module provides add_arguments(parser) and main(args) -> exit code.
    for name, module, help_text in [
        ("memory", reservation, "reserved vs live KV memory: contiguous vs paged cache"),
        ("latency", latency, "TTFT / ITL / throughput under Poisson arrivals, swept over request rates"),
        ("throughput", throughput, "output tokens/s: radarlab engine vs transformers vs vLLM"),
        ("quant", kv_quant, "KV formats: bytes, attention error, perplexity, concurrency at a fixed budget"),
        ("spec", speculation, "tokens/s with and without speculative decoding: radarlab vs vLLM"),
        ("profile", profile, "the engine's decode step by op group, per dtype and batch size"),
    ]:
        p = sub.add_parser(name, help=help_text, description=module.__doc__.splitlines()[0])
        module.add_arguments(p)
        p.set_defaults(run=module.main, subparser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ValueError as err:  # a bad parameter: argparse's usage message and exit status 2
        args.subparser.error(_name_the_flag(str(err), args))


def _name_the_flag(message: str, args: argparse.Namespace) -> str:
    """A config's error starts with the field it is about (max_tokens must be ...); on the command line,
    say which flag that is (--max-tokens: max_tokens must be ...)."""
    field = message.split(" ", 1)[0]
    if field in vars(args) and field not in ("run", "subparser"):
        return f"--{field.replace('_', '-')}: {message}"
    return message


if __name__ == "__main__":
    sys.exit(main())
