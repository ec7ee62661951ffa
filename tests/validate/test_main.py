"""`python -m radarlab.validate --sections`: which parts of the table run, and bad lists refused."""
from __future__ import annotations

import pytest

from radarlab.validate.__main__ import SECTIONS, main, parse_sections


def test_sections_come_back_in_table_order():
    assert parse_sections("fp8,hf") == ("hf", "fp8")
    assert parse_sections(" spec , vllm ,spec") == ("vllm", "spec")
    assert parse_sections(",".join(reversed(SECTIONS))) == SECTIONS


def test_skip_vllm_leaves_the_transformers_rows():
    assert parse_sections(",".join(SECTIONS), skip_vllm=True) == ("hf",)


@pytest.mark.parametrize("text", ["fp9", "hf,paged,int4", "", " , "])
def test_an_unknown_or_empty_list_is_refused_by_name(text):
    with pytest.raises(ValueError, match="--sections takes a comma list of hf, vllm") as err:
        parse_sections(text)
    assert repr(text) in str(err.value)


def test_the_command_line_names_a_bad_section(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--sections", "fp8,kivi"])
    assert exit_.value.code == 2 and "'fp8,kivi'" in capsys.readouterr().err
