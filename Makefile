# cleave: `make demo` runs the main job on a bundled default, `make test` runs every test.
# Every target sets itself up: a project venv with PyTorch 2.11.0 (libtorch for tch 0.24),
# the exporter installed in it, and a release build linked against that libtorch.

SHELL := /bin/bash
VENV := .venv
PYTHON := $(CURDIR)/$(VENV)/bin/python
# torch-sys takes libtorch from the venv's PyTorch; its python must come first on PATH.
export LIBTORCH_USE_PYTORCH := 1
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

TEST_BUNDLES := $(CURDIR)/target/test-bundles
DEMO_BUNDLE := bundles/resnet18
DIGITS_TRAINED := bundles/digits-trained
DIGITS_TEST := bundles/digits-test.safetensors
DIGITS_CNN := bundles/digits-cnn
DIGITS_TRAIN := bundles/digits-train.safetensors
BENCH_ACTIVATIONS := bundles/resnet18-activations.safetensors
EXPORTER_SOURCES := $(wildcard tools/export/cleave_export/*.py) tools/export/tests/models.py
EXPORT := cd tools/export && $(PYTHON) -m cleave_export --force -q

# The import-cycle check reads every crate's source and the exporter's modules: no circles
# between files, nor between a crate's top-level modules.
CYCLE_CHECK := python3 tools/export/check_import_cycles.py --python tools/export/cleave_export \
	--rust client/src --rust common/codec/src --rust common/src --rust common/tables/src --rust server/src --rust host/src

.PHONY: setup build lint test test-bundles extras test-extras demo demo-secure demo-train demo-train-fed digits-trained digits-cnn bench-activations link-sweep train-pipeline chaos hostile-rss generation-floods bench-serving bench-generate image image-bases deploy-check clean

setup: build

$(VENV)/.installed: tools/export/requirements.txt tools/export/pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -r tools/export/requirements.txt
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps -e tools/export
	touch $@

# What `build` compiles; the image's build stage narrows it to the server.
BUILD_SCOPE := --workspace
build: $(VENV)/.installed
	cargo build --release $(BUILD_SCOPE)

# Small transformers (random weights from configs): an LM with tied embedding and head, a
# Llama-like LM, a BERT-like classifier and a vision transformer.
HF_SMALL_GPT2 := n_layer=4,n_embd=32,n_head=4,n_inner=64,vocab_size=500,n_positions=64
HF_SMALL_LLAMA := num_hidden_layers=2,hidden_size=32,num_attention_heads=4,num_key_value_heads=2,intermediate_size=64,vocab_size=500,max_position_embeddings=64
HF_SMALL_BERT := num_hidden_layers=2,hidden_size=32,num_attention_heads=4,intermediate_size=64,vocab_size=500,max_position_embeddings=64,num_labels=3
HF_SMALL_VIT := num_hidden_layers=2,hidden_size=32,num_attention_heads=4,intermediate_size=64,image_size=32,patch_size=8,num_labels=5

# Bundles the Rust tests run: every model the foundation issue names, each cut finely, with
# references at batch 1, 3 and 8; a tiny batch-norm/dropout/residual model for split training;
# models as users write them (a submodule named `meta`, Whisper's encoder fed log-mel features,
# a user's module around GPT-2);
# the small transformers above (sequences of 1 to 32 tokens);
# and the digits train and test splits (`x`, `label`). Re-exported only when the exporter changes.
$(TEST_BUNDLES)/.stamp: $(VENV)/.installed $(EXPORTER_SOURCES)
	rm -rf $(TEST_BUNDLES) && mkdir -p $(TEST_BUNDLES)
	$(EXPORT) cleave_export.zoo:digits_cnn --granularity op --dynamic-batch 1 16 --reference-batches 1,3,8 --out $(TEST_BUNDLES)/digits
	$(EXPORT) tests.models:tiny_transformer --granularity op --dynamic-batch 1 16 --reference-batches 1,3,8 --out $(TEST_BUNDLES)/transformer
	$(EXPORT) torchvision:resnet18 --granularity layer --input-shape 3,64,64 --reference-batches 1,3,8 --out $(TEST_BUNDLES)/resnet18
	$(EXPORT) torchvision:mobilenet_v3_small --granularity layer --input-shape 3,64,64 --reference-batches 1,3,8 --out $(TEST_BUNDLES)/mobilenet_v3_small
	$(EXPORT) torchvision:efficientnet_b0 --granularity layer --input-shape 3,64,64 --reference-batches 1,3,8 --out $(TEST_BUNDLES)/efficientnet_b0
	$(EXPORT) tests.models:bn_dropout_residual --granularity op --dynamic-batch 1 64 --reference-batches 1,3,8 --out $(TEST_BUNDLES)/bn_dropout
	$(EXPORT) tests.models:image_and_metadata --granularity op --dynamic-batch 1 16 --reference-batches 1,3,8 --out $(TEST_BUNDLES)/image_meta
	$(EXPORT) tests.models:tiny_whisper_encoder --dynamic-batch 1 16 --reference-batches 1,3,8 --out $(TEST_BUNDLES)/whisper_encoder
	$(EXPORT) tests.models:tiny_wav2vec2 --dynamic-batch 1 16 --dynamic-seq 4 40 --reference-batches 1,3,8 --out $(TEST_BUNDLES)/wav2vec2
	$(EXPORT) tests.models:wrapped_gpt2 --dynamic-batch 1 16 --dynamic-seq 1 32 --reference-batches 1,3,8 --out $(TEST_BUNDLES)/wrapped_gpt2
	$(EXPORT) hf:GPT2LMHeadModel --hf-config $(HF_SMALL_GPT2) --dynamic-batch 1 16 --dynamic-seq 1 32 --reference-batches 1,3,8 --generation --out $(TEST_BUNDLES)/gpt2
	$(EXPORT) hf:LlamaForCausalLM --hf-config $(HF_SMALL_LLAMA) --dynamic-batch 1 16 --dynamic-seq 1 32 --reference-batches 1,3,8 --generation --out $(TEST_BUNDLES)/llama
	$(EXPORT) hf:BertForSequenceClassification --hf-config $(HF_SMALL_BERT) --dynamic-batch 1 16 --dynamic-seq 1 32 --reference-batches 1,3,8 --out $(TEST_BUNDLES)/bert
	$(EXPORT) hf:ViTForImageClassification --hf-config $(HF_SMALL_VIT) --dynamic-batch 1 16 --reference-batches 1,3,8 --out $(TEST_BUNDLES)/vit
	cd tools/export && $(PYTHON) -m cleave_export.datasets digits --part train --out $(TEST_BUNDLES)/digits-train.safetensors
	cd tools/export && $(PYTHON) -m cleave_export.datasets digits --part test --out $(TEST_BUNDLES)/digits-test.safetensors
	touch $@

test-bundles: $(TEST_BUNDLES)/.stamp

# Optional model libraries for `timm:NAME` and `ultralytics:CONFIG.yaml` sources, into the
# project venv (ultralytics without its desktop OpenCV: the pinned headless build); then
# their tests, which skip without them.
extras: $(VENV)/.installed
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -r tools/export/requirements-extras.txt
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps ultralytics==8.4.190

test-extras: extras
	cd tools/export && $(PYTHON) -m pytest -q tests/test_model_libraries.py

# Formatting, clippy with warnings denied (the workspace, and the host without the server
# crate), the exporter's linter, no import circles between files or modules, and the claims of
# ARCHITECTURE.md that a search can check.
lint: $(VENV)/.installed
	cargo fmt --all --check
	cargo clippy --release --workspace --all-targets -- -D warnings
	cargo clippy --release -p cleave-host --no-default-features -- -D warnings
	cd tools/export && $(CURDIR)/$(VENV)/bin/ruff check .
	$(CYCLE_CHECK)
	python3 tools/export/check_architecture.py
	python3 tools/export/check_client_deps.py

# Lint first; `build` before the tests: the exporter tests run the release `host` against
# torch.optim (and must not skip).
test: lint build $(TEST_BUNDLES)/.stamp
	CLEAVE_TEST_BUNDLES=$(TEST_BUNDLES) cargo test --release --workspace
	cd tools/export && CLEAVE_REQUIRE_HOST=1 $(PYTHON) -m pytest -q tests

$(DEMO_BUNDLE)/manifest.json: $(VENV)/.installed $(EXPORTER_SOURCES)
	$(PYTHON) -m cleave_export torchvision:resnet18 --force --out $(DEMO_BUNDLE)

# The digits CNN trained on sklearn's digits (a few seconds on CPU), cut at every op, batches up
# to 512 so the whole test split (359 images) is one request; and that test split as host input
# (`x`, with the labels as `label`, which the host ignores). Both are remade when the exporter changes.
$(DIGITS_TRAINED)/manifest.json: $(VENV)/.installed $(EXPORTER_SOURCES)
	$(EXPORT) cleave_export.zoo:digits_cnn_trained --granularity op --dynamic-batch 1 512 --out $(CURDIR)/$(DIGITS_TRAINED)

$(DIGITS_TEST): $(VENV)/.installed tools/export/cleave_export/datasets.py
	cd tools/export && $(PYTHON) -m cleave_export.datasets digits --out $(CURDIR)/$@

digits-trained: $(DIGITS_TRAINED)/manifest.json $(DIGITS_TEST)

# The same CNN untrained (for split training from scratch), cut at every op, batches up to 512;
# with the train split to train on and the test split to score it.
$(DIGITS_CNN)/manifest.json: $(VENV)/.installed $(EXPORTER_SOURCES)
	$(EXPORT) cleave_export.zoo:digits_cnn --granularity op --dynamic-batch 1 512 --out $(CURDIR)/$(DIGITS_CNN)

$(DIGITS_TRAIN): $(VENV)/.installed tools/export/cleave_export/datasets.py
	cd tools/export && $(PYTHON) -m cleave_export.datasets digits --part train --out $(CURDIR)/$@

digits-cnn: $(DIGITS_CNN)/manifest.json $(DIGITS_TRAIN) $(DIGITS_TEST)

# Real boundary tensors for the codec benches (`cargo bench -p cleave-codec`): resnet18 at
# 224x224, batch 8, at cut 4 (after the stem's maxpool, 64x56x56), cut 8 (after layer2,
# 128x28x28) and cut 12 (after layer4, 512x7x7).
$(BENCH_ACTIVATIONS): $(DEMO_BUNDLE)/manifest.json tools/export/cleave_export/activations.py
	cd tools/export && $(PYTHON) -m cleave_export.activations $(CURDIR)/$(DEMO_BUNDLE) --cuts 4,8,12 --batch 8 --out $(CURDIR)/$@

bench-activations: $(BENCH_ACTIVATIONS)

# The demo replaces its own earlier results (`--force`); a plain `host` run refuses to.
demo: build $(DEMO_BUNDLE)/manifest.json
	target/release/host splits --bundle $(DEMO_BUNDLE)
	target/release/host --config config/demo.yaml --loopback --force

# Split training of the digits CNN from scratch over loopback gRPC, then the same training of
# the whole model in one process (same stages, optimizer, seeds and batches), and the two side by side.
demo-train: build digits-cnn
	target/release/host --config config/train-digits.yaml --loopback --force
	target/release/host --config config/train-digits.yaml --monolithic --output results/train-digits-monolithic --force
	$(PYTHON) -c 'import json; runs = [("split over loopback", "results/train-digits"), ("monolithic", "results/train-digits-monolithic")]; \
	s = {name: json.load(open(d + "/summary.json")) for name, d in runs}; \
	[print("%20s: final test accuracy %.2f%%, median epoch %.3f s, median step %.2f ms" % (n, v["final_test_accuracy"] * 100, v["median_epoch_seconds"], v["median_step_ms"])) for n, v in s.items()]; \
	print("accuracy difference: %.2f points" % (abs(s["split over loopback"]["final_test_accuracy"] - s["monolithic"]["final_test_accuracy"]) * 100))'

# SplitFed over 127.0.0.1: a server and four edges, each on its own quarter of the digits
# training split, FedAvg after every epoch; then one edge with all the data, for comparison.
demo-train-fed: build digits-cnn
	tools/demo/train-fed

# Development secrets for the secured demo (a CA, a server certificate for localhost, a
# payload key, a token), written once into the git-ignored .dev-secrets/.
.dev-secrets/token: | build
	target/release/server dev-secrets --out .dev-secrets

# The demo over a secured link: shuffle+lz4, AES-256-GCM payloads, TLS and a bearer token.
demo-secure: build $(DEMO_BUNDLE)/manifest.json .dev-secrets/token
	target/release/host --config config/demo-secure.yaml --loopback --force

# The networked bench (as root): resnet18 cut at its top-level modules, batches 1 to 8; the
# server and the host in two network namespaces over an HTB-shaped veth link (bench/README.md).
LINK_SWEEP_BUNDLE := bundles/resnet18-top
$(LINK_SWEEP_BUNDLE)/manifest.json: $(VENV)/.installed $(EXPORTER_SOURCES)
	$(EXPORT) torchvision:resnet18 --granularity top --dynamic-batch 1 8 --out $(CURDIR)/$(LINK_SWEEP_BUNDLE)

# A 2,000-request run while its server is killed, stopped and restarted (bench/README.md).
chaos: build $(TEST_BUNDLES)/.stamp
	bench/chaos

# The server's RSS while peers stall 64 MiB requests, send zstd bombs, say nothing or never read (bench/README.md).
hostile-rss: build $(DEMO_BUNDLE)/manifest.json
	cargo run --release -q -p cleave-tests --example hostile_rss -- --bundle $(DEMO_BUNDLE)

# A lone generator's decode rate beside floods of other peers' generation sessions: decode,
# prefill, NaN (bench/README.md); bench/generate's 4-layer GPT-2 of width 256, exported on first use.
GENERATION_BUNDLE := target/bench-bundles/gpt2-gen
$(GENERATION_BUNDLE)/manifest.json: $(VENV)/.installed $(EXPORTER_SOURCES)
	$(EXPORT) hf:GPT2LMHeadModel --hf-config n_layer=4,n_embd=256,n_head=4 --generation --out $(CURDIR)/$(GENERATION_BUNDLE)

generation-floods: build $(GENERATION_BUNDLE)/manifest.json
	cargo run --release -q -p cleave-tests --example generation_floods -- --bundle $(GENERATION_BUNDLE)

# One server, many edges and models, measured with `host load`: batching, edf against fifo,
# merging across cuts (bench/README.md).
bench-serving: build $(TEST_BUNDLES)/.stamp $(DEMO_BUNDLE)/manifest.json digits-cnn
	bench/serving

link-sweep: build $(LINK_SWEEP_BUNDLE)/manifest.json
	bench/link-sweep --bundle $(LINK_SWEEP_BUNDLE)

# Split training's step time at 1, 2, 4 and 8 pipelined micro-batches, loopback and shaped
# links (root: network namespaces); exports resnet18 at 64x64 on first use.
train-pipeline: build digits-cnn
	bench/train-pipeline

# Split generation against transformers' generate with its cache, tokens per second: a
# 4-layer GPT-2 and a Llama-like model of width 256, split in the middle (bench/README.md).
bench-generate: build $(VENV)/.installed
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH bench/generate

# Containers (root; deploy/README.md): the base images made locally where they cannot be pulled;
# the CUDA server, CPU server and edge images, with docker or podman; and the CPU overlay run
# under podman with a pod killed and another replaced mid-run.
image-bases:
	deploy/image-bases

image:
	deploy/build-image

deploy-check: image $(VENV)/.installed $(DEMO_BUNDLE)/manifest.json
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -r deploy/requirements-check.txt
	$(PYTHON) deploy/check

clean:
	rm -rf target bundles results
