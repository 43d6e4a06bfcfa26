# BFCL (jetrl eval --suite bfcl): bfcl-eval is installed by `make venv`. A slice of it against SmolLM2
# through every service (~2 min on 2 cores), outside `make test`.
.PHONY: test-bfcl

test-bfcl: venv
	$(BIN)/python -m pytest -q -ra -m bfcl_model tests/envs/test_env_bfcl.py
