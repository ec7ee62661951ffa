"""Shared fixtures: the course model loaded once per test session; the learner copies' runs."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import radarlab  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)
from radarlab.exercises import course_notebooks

from copy_runs import COPIES_TESTS, CopyRuns

ROOT = Path(__file__).resolve().parents[1]

if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # `make test` runs two workers: share the cores out
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


def pytest_configure(config):
    """The learner copies run as a plugin: it sees the notebooks' items too, to start beside them."""
    config.pluginmanager.register(CopyRuns(course_notebooks(ROOT / "notebooks" / "exercises")), "copy_runs")


@pytest.fixture(scope="session")
def copy_runs(pytestconfig) -> CopyRuns:
    """The learner copies' runs (tests/copy_runs.py): `.result(path)` waits for one copy."""
    return pytestconfig.pluginmanager.get_plugin("copy_runs")


@pytest.fixture(scope="session")
def hf_model_and_tokenizer():
    """transformers' fp32 model with eager (plain-math) attention, and the tokenizer."""
    from radarlab.models.loader import load_hf

    return load_hf(None, dtype=torch.float32, attn_implementation="eager")


@pytest.fixture(scope="session")
def hf_model(hf_model_and_tokenizer):
    return hf_model_and_tokenizer[0]


@pytest.fixture(scope="session")
def tokenizer(hf_model_and_tokenizer):
    return hf_model_and_tokenizer[1]


@pytest.fixture(scope="session")
def model(hf_model):
    """Our Llama forward with the course model's fp32 weights."""
    from radarlab.models.llama import Llama

    return Llama.from_hf(hf_model)


@pytest.fixture(scope="session")
def tiny():
    """A 2-layer random-weight Llama with a 128-token vocabulary: fast, and its logits are far from
    ties, so greedy outputs are exact across batchings."""
    from radarlab.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    return Llama(cfg).eval()


@pytest.fixture(scope="session")
def tiny_sharp():
    """A 2-layer random Llama (61-token vocabulary, GQA) with large weights: its logits are far apart,
    so greedy tokens depend on every K/V and a wrong cache read changes them."""
    from radarlab.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    model = Llama(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


@pytest.fixture(scope="session")
def prompts(tokenizer):
    """Eight fixed prompts as token ids."""
    from radarlab.validate.prompts import VALIDATION_PROMPTS

    return [tokenizer(p)["input_ids"] for p in VALIDATION_PROMPTS]


# Fixtures that load the course model (seconds each, and gigabytes): a test that uses one is `slow`.
COURSE_MODEL_FIXTURES = {"hf_model_and_tokenizer"}


@pytest.hookimpl(tryfirst=True)  # marks before -m deselects by them
def pytest_collection_modifyitems(config, items):
    """Tests that load the course model are marked slow (make test-fast leaves them out). The heaviest
    work units go first (heaviest_first). vLLM tests skip when .venv-vllm is absent, unless
    RADARLAB_REQUIRE_VLLM=1 (make test sets it)."""
    for item in items:
        if COURSE_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    heaviest_first(items)
    if os.environ.get("RADARLAB_REQUIRE_VLLM") == "1":
        return
    from radarlab.validate.vllm import vllm_python

    if vllm_python() is None:
        skip = pytest.mark.skip(reason="no vLLM environment; run `make vllm`")
        for item in items:
            if "vllm" in item.keywords:
                item.add_marker(skip)


def work_unit(nodeid: str) -> str:
    """The pytest-xdist work unit of a test (make test runs two workers): a unit runs on one worker, in
    order. The notebooks and the learner copies' tests are one unit: nbval runs a notebook's cells
    in one kernel, and the copies run beside the notebooks on that worker's threads (copy_runs.py).
    Every test file is a unit of its own, so a module's fixture (one vLLM run) is made once."""
    path = nodeid.split("::")[0]
    return "notebooks" if path.endswith(".ipynb") or path.endswith("/" + COPIES_TESTS) else path


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's
def pytest_xdist_make_scheduler(config, log):
    """Schedule by work_unit (xdist's loadgroup reads a nodeid suffix that pytest 9 no longer keeps)."""
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnits(config, log)


def heaviest_first(items) -> None:
    """The notebooks' unit first, then the files with a `vllm` or `slow` test, each kept in
    collection order, so that no minutes-long file is left to the end while the other worker waits
    (make test queues the units in this order: --no-loadscope-reorder)."""
    unit = {item.nodeid: work_unit(item.nodeid) for item in items}
    heavy = {unit[item.nodeid] for item in items if "vllm" in item.keywords or "slow" in item.keywords}
    rank = {u: 0 if u == "notebooks" else 1 if u in heavy else 2 for u in unit.values()}
    items.sort(key=lambda item: rank[unit[item.nodeid]])
