"""`python -m radarlab.bench`: a bad flag of any subcommand exits 2 with a message naming the flag, before
any model loads."""
from __future__ import annotations

import pytest

from radarlab.bench.__main__ import main as bench_main


@pytest.mark.parametrize("argv, flag", [
    (["latency", "--rates", "0"], "--rates"), (["latency", "--rates", "-1,2"], "--rates"),
    (["latency", "--rates", "fast"], "--rates"), (["latency", "--num-requests", "0"], "--num-requests"),
    (["latency", "--output-len", "0"], "--output-len"),
    (["latency", "--max-num-seqs", "-1"], "--max-num-seqs"),
    (["latency", "--seed", "-1"], "--seed"), (["latency", "--threads", "0"], "--threads"),
    (["latency", "--budgets", "64,x"], "--budgets"), (["latency", "--budgets", "64,-1"], "--budgets"),
    (["latency", "--budget-rate", "0"], "--budget-rate"),
    (["throughput", "--batch-sizes", "1,x"], "--batch-sizes"),
    (["throughput", "--batch-sizes", "0"], "--batch-sizes"),
    (["throughput", "--dtypes", "int8"], "--dtypes"), (["throughput", "--max-tokens", "-3"], "--max-tokens"),
    (["throughput", "--min-prompt-len", "9", "--max-prompt-len", "8"], "--min-prompt-len"),
    (["spec", "--max-tokens", "0"], "--max-tokens"),
    (["spec", "--methods", "ngram,ngram"], "--methods"),
    (["quant", "--quick", "--schemes", "int5"], "int5"),
])
def test_a_bad_flag_exits_2_naming_it(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_main(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err
