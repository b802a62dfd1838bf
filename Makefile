# SFT-Play: the front door. Each target calls one script; the logic lives in sft_play/.
# Variables: CONFIG (run config), ARGS ("key=value ..." overrides), RUN (a run folder),
# PROMPT and IMAGE (for generate), PYTHON (interpreter that creates the venv), PIP_ARGS (extra pip flags).

PYTHON ?= python3
VENV ?= .venv
# exec: make waits for the script itself, not for a shell that a stop signal kills before training saves
PY := exec $(VENV)/bin/python
# gpu-info and plan print JSON with ARGS=--json: their command lines are not echoed (@), so that
# their output parses as it is (make gpu-info ARGS=--json | python3 -m json.tool)
STAMP := $(VENV)/.installed
CONFIG ?= configs/run_tiny.yaml
ARGS ?=
RUN ?=
RUNS ?= runs
PROMPT ?=
IMAGE ?=
PIP_ARGS ?=
NUM_GPUS ?=
VRAM_GIB ?=
GPU_MODEL ?=
PLOT ?=
LONGEST ?=
HOST_GIB ?=
GPUS ?=
NNODES ?= 1
NODE_RANK ?= 0
MASTER_ADDR ?=
MASTER_PORT ?=
CPU ?=
OVERSUBSCRIBE ?=
AUTO ?=
FORCE ?=
RESUME ?=
ACCELERATE_CONFIG ?= configs/accelerate/ddp.yaml

RUN_FLAG = $(if $(RUN),--run $(RUN))
# A finished run is used with the config it saved: CONFIG only says where runs are, when given
RUN_CONFIG = $(if $(filter file,$(origin CONFIG)),,--config $(CONFIG))
RESUME_ARG = $(if $(RESUME),train.resume_from=$(RESUME))
LAUNCH_FLAGS = $(if $(NUM_GPUS),--num-gpus $(NUM_GPUS)) $(if $(GPUS),--gpus $(GPUS)) --nnodes $(NNODES) \
	--node-rank $(NODE_RANK) $(if $(MASTER_ADDR),--master-addr $(MASTER_ADDR)) \
	$(if $(MASTER_PORT),--master-port $(MASTER_PORT)) $(if $(CPU),--cpu) $(if $(OVERSUBSCRIBE),--oversubscribe)

# What a user types as free text never goes through a shell (but for test and the bench targets,
# whose ARGS are pytest's and the benches' own): ARGS reaches the commands through the environment,
# read by sft_play.cli.run (`...`, $(...) and $VAR in it stay text, quotes group words as a shell's
# would); PROMPT, IMAGE, DATA and GPU_MODEL as the values of shell variables, which a shell does not
# evaluate. Neither they nor the paths are exported as typed (make would expand a $(shell ...) in them).
unexport ARGS PROMPT IMAGE DATA GPU_MODEL CONFIG RUN RUNS PLOT
export SFT_PLAY_PROMPT = $(value PROMPT)
export SFT_PLAY_IMAGE = $(value IMAGE)
export SFT_PLAY_DATA = $(value DATA)
export SFT_PLAY_GPU_MODEL = $(value GPU_MODEL)
check gpu-info plan data-stats setup-accelerate train train-tb train-distributed train-distributed-tb train-deepspeed train-deepspeed-tb generate chat eval merge planner-check clean-cache: export SFT_PLAY_ARGS = $(value ARGS)

.DEFAULT_GOAL := help

.PHONY: help install check gpu-info plan data-stats setup-accelerate train train-tb train-distributed train-distributed-tb \
	train-deepspeed train-deepspeed-tb tensorboard generate chat eval merge planner-check lint test bench-gpu bench-planner bench-tiny clean \
	clean-cache

help: ## List the targets
	@if [ -t 1 ] && [ -z "$$NO_COLOR" ]; then on=$$(printf '\033[36m'); off=$$(printf '\033[0m'); fi; awk -v on="$$on" -v off="$$off" 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %s%-22s%s %s\n", on, $$1, off, $$2}' $(MAKEFILE_LIST)

# pip byte-compiles what it installs one file at a time (half the install); compileall does it on
# every core, but for the packages' own test suites (a fifth of the files), which nothing imports.
# As with pip, a file that does not compile (torch ships Python 3.12 syntax) stays source. The
# planner's compiled replay is compiled here too, not by the first plan. The pip a venv starts with is
# the one its Python bundled, which can be years old: a current one chooses the pinned releases from a
# package index in a fraction of the time (docs/reports/test_suite.md). This package is built with the
# setuptools just installed (torch's dependency), not one fetched into an isolated env, and without the
# note on editable installs that pip passes on from its build.
$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --no-compile $(PIP_ARGS) pip==26.3 || true  # (where the index has it)
	$(VENV)/bin/pip install --quiet --no-compile $(PIP_ARGS) -r requirements.txt
	PYTHONWARNINGS=ignore $(VENV)/bin/pip install --quiet --no-compile --no-deps --no-build-isolation $(PIP_ARGS) -e .
	$(VENV)/bin/python -m compileall -qq -j 0 -x '/site-packages/.+/tests?/' $(VENV)/lib || true
	$(VENV)/bin/python -m sft_play.planner.simulate
	touch $@

install: $(STAMP) ## Create .venv, install the pinned requirements and this package (editable); re-runs when they change

check: $(STAMP) ## Validate CONFIG, the environment, the data, the output folder and the disk
	$(PY) scripts/check.py --config $(CONFIG)

gpu-info: $(STAMP) ## Print GPUs, CPU and RAM (--json: make gpu-info ARGS=--json)
	@$(PY) scripts/gpu_info.py

plan: $(STAMP) ## Plan CONFIG's batch, per-GPU memory and time (NUM_GPUS=8 VRAM_GIB=80 GPU_MODEL=H100 NNODES=2 for other hardware, PLOT=plan.png, LONGEST=1: the longest rows that fit, HOST_GIB=512; ARGS=--no-data: without reading the data)
	@$(PY) scripts/plan.py --config $(CONFIG) $(if $(NUM_GPUS),--gpus $(NUM_GPUS)) $(if $(VRAM_GIB),--vram-gib $(VRAM_GIB)) $(if $(filter-out 1,$(NNODES)),--nodes $(NNODES)) $(if $(value GPU_MODEL),--gpu-model "$$SFT_PLAY_GPU_MODEL") $(if $(PLOT),--plot $(PLOT)) $(if $(LONGEST),--longest) $(if $(HOST_GIB),--host-gib $(HOST_GIB))

data-stats: $(STAMP) ## CONFIG's data as training sees it: examples, token lengths, truncation, loss share, packed rows
	$(PY) scripts/data_stats.py --config $(CONFIG)

setup-accelerate: $(STAMP) ## Write configs/accelerate/local.yaml with accelerate's wizard (AUTO=1: from the hardware, no questions)
	$(PY) scripts/setup_accelerate.py $(if $(AUTO),--auto) $(if $(FORCE),--force)

train: $(STAMP) ## Train on one device (default CONFIG: the embedded tiny model, every weight fine-tuned, 2-3 min on 2 CPU cores); RESUME=auto continues
	$(PY) scripts/train_distributed.py --config $(CONFIG) $(RESUME_ARG)

train-tb: $(STAMP) ## Train with TensorBoard on a free loopback port; it stops when training ends
	$(PY) scripts/launch.py --launcher python --tensorboard --config $(CONFIG) $(RESUME_ARG)

train-distributed: $(STAMP) ## DDP (FSDP2 with distributed.strategy=fsdp2) on NUM_GPUS GPUs (default all; GPUS=0,1 picks; CPU=1: processes on the CPU) via accelerate; NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT for many nodes
	$(PY) scripts/launch.py --launcher accelerate --accelerate-config $(ACCELERATE_CONFIG) $(LAUNCH_FLAGS) --config $(CONFIG) $(RESUME_ARG)

train-distributed-tb: $(STAMP) ## train-distributed with TensorBoard on a free loopback port (URL printed)
	$(PY) scripts/launch.py --launcher accelerate --accelerate-config $(ACCELERATE_CONFIG) $(LAUNCH_FLAGS) --tensorboard --config $(CONFIG) $(RESUME_ARG)

train-deepspeed: $(STAMP) ## DeepSpeed ZeRO-2 (configs/deepspeed_z2.json, 'auto' values from the plan; ZeRO-3 with distributed.strategy=deepspeed_zero3) via torchrun; same variables
	$(PY) scripts/launch.py --launcher torchrun --deepspeed $(LAUNCH_FLAGS) --config $(CONFIG) $(RESUME_ARG)

train-deepspeed-tb: $(STAMP) ## train-deepspeed with TensorBoard on a free loopback port (URL printed)
	$(PY) scripts/launch.py --launcher torchrun --deepspeed $(LAUNCH_FLAGS) --tensorboard --config $(CONFIG) $(RESUME_ARG)

tensorboard: $(STAMP) ## Serve TensorBoard for RUN (default: every run under the output folder)
	$(PY) scripts/serve_tensorboard.py $(RUN_CONFIG) $(RUN_FLAG)

generate: $(STAMP) ## Answer PROMPT (about the picture IMAGE, for a vision-language run) with RUN (default: the newest run; held-out prompts when PROMPT is empty)
	$(PY) scripts/generate.py $(RUN_CONFIG) $(RUN_FLAG) $(if $(value PROMPT),--prompt "$$SFT_PLAY_PROMPT") $(if $(value IMAGE),--image "$$SFT_PLAY_IMAGE")

chat: $(STAMP) ## Chat with RUN in the terminal (default: the newest run)
	$(PY) scripts/chat.py $(RUN_CONFIG) $(RUN_FLAG)

eval: $(STAMP) ## Validation loss, perplexity and held-out generations of RUN (default: the newest run) -> RUN/eval.json (DATA=test.jsonl: other data -> RUN/eval-test.json; ARGS=data.on_invalid=skip leaves its bad rows out)
	$(PY) scripts/evaluate.py $(RUN_CONFIG) $(RUN_FLAG) $(if $(value DATA),--data "$$SFT_PLAY_DATA")

merge: $(STAMP) ## Merge RUN's LoRA/QLoRA adapter into its base -> RUN/merged (safetensors + tokenizer)
	$(PY) scripts/merge.py $(RUN_CONFIG) $(RUN_FLAG)

planner-check: $(STAMP) ## The planner's error on your hardware: every run's predicted vs measured peak (RUNS=runs/)
	$(PY) scripts/planner_check.py --runs $(RUNS)

lint: $(STAMP) ## Check the code with ruff (the rules pyproject.toml selects); make test runs it first
	$(PY) -m ruff check --quiet sft_play scripts bench tests

test: $(STAMP) lint ## Lint, then run the test suite (CPU, no network)
	$(PY) -m pytest $(ARGS)

bench-gpu: $(STAMP) ## GPU truth in one lease: speed, memory, time; every figure kept as it comes, a second call goes on (CPU: a smoke run); writes docs/reports/gpu_lease.md
	$(PY) bench/lease.py $(ARGS)

bench-planner: $(STAMP) ## Measure the planner's accuracy on this GPU (CPU: a smoke run); writes docs/reports/planner_accuracy.md
	$(PY) bench/planner_accuracy.py $(ARGS)

bench-tiny: $(STAMP) ## make train's time and held-out answers per seed and CPU precision path (~15 min on 2 cores); writes docs/reports/tiny_default.md
	$(PY) bench/tiny_default.py $(ARGS)

clean: ## Remove run folders and pytest's cache (keeps .venv, and the data and planner caches in $SFT_PLAY_CACHE or ~/.cache/sft_play)
	rm -rf runs .pytest_cache

clean-cache: $(STAMP) ## Show $SFT_PLAY_CACHE (~/.cache/sft_play) and delete entries unused for 14 days (ARGS="--days 3", "--all", "--dry-run")
	$(PY) scripts/clean_cache.py
