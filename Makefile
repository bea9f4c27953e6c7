# The two commands a newcomer runs: `make run` and `make test`.
# Both install missing Debian packages (tools/install-deps.sh), build Release and
# generate the bundled fixture first.

BUILD      ?= build
FUZZ_BUILD ?= build-fuzz
EMU_BUILD  ?= build-emu
JOBS       ?= $(shell nproc)
FIXTURE    ?= $(BUILD)/fixtures/qwen3moe-tiny.gguf
SERVE_FIXTURE ?= $(BUILD)/fixtures/qwen3moe-small-qwen3vocab.gguf
FUZZ_SECONDS ?= 60
MOEGRAPH   := $(BUILD)/tools/moegraph

.PHONY: all deps build fixture run test test-sanitize test-emulated bench crosscheck crosscheck-speed serve-bench clean

all: build

deps:
	@bash tools/install-deps.sh
	@bash tools/fetch-vocab.sh
	@bash tools/openai-client/install.sh

build: deps
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release
	cmake --build $(BUILD) -j$(JOBS)

fixture: build
	@mkdir -p $(dir $(FIXTURE))
	$(MOEGRAPH) make-fixture --arch qwen3moe --layers 4 --experts 16 --top-k 4 \
	  --embd 256 --ff 256 --heads 8 --kv-heads 4 --vocab 512 --quant q8_0,expert=q4_K \
	  --router-skew 2 --seed 1 -o $(FIXTURE)

# The model trained here answering a prompt (models/, tools/train-moe), then the
# replay benchmark on the fixture: CUDA when a device exists, else the CPU backend.
run: fixture
	$(MOEGRAPH) run -m models/kjv-moe-f16.gguf -p "And God said unto Moses," -n 48
	$(MOEGRAPH) bench -m $(FIXTURE) --arms resident,graph,host,stage --slots 16,32 -p 0 -n 32 -r 2

# Release tests, then the sanitizer tree: the GGUF reader's tests under
# ASan+UBSan and the libFuzzer target for FUZZ_SECONDS; then the emulated tree.
test: fixture
	ctest --test-dir $(BUILD) --output-on-failure -j$(JOBS)
	$(MAKE) --no-print-directory test-sanitize
	$(MAKE) --no-print-directory test-emulated

test-sanitize: deps
	cmake -S . -B $(FUZZ_BUILD) -DMOEGRAPH_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DMOEGRAPH_FUZZ_SECONDS=$(FUZZ_SECONDS)
	cmake --build $(FUZZ_BUILD) -j$(JOBS)
	ctest --test-dir $(FUZZ_BUILD) --output-on-failure

# The CUDA sources on the CPU emulator (docs/EMULATOR.md), under ASan+UBSan:
# the emulator's tests, the GPU tests, the CLI on CUDA and the CUDA gates under
# three seeds, then the mutations each emulated test must catch.
test-emulated: deps
	cmake -S . -B $(EMU_BUILD) -DMOEGRAPH_EMULATE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
	cmake --build $(EMU_BUILD) -j$(JOBS)
	ctest --test-dir $(EMU_BUILD) --output-on-failure -j$(JOBS)
	tools/emulator-mutations.sh $(EMU_BUILD)

bench: build
	$(BUILD)/tools/moegraph_bench --benchmark_min_time=0.5

# moegraph serve's cost per request beside the engine alone (docs/SERVER.md):
# crosscheck-speed's small fixture with Qwen3's vocabulary.
serve-bench: build
	@test -f $(SERVE_FIXTURE) || $(MOEGRAPH) make-fixture --arch qwen3moe --heads 16 --kv-heads 4 \
	  --quant q8_0,expert=q4_K --seed 1 --layers 8 --experts 32 --top-k 4 --embd 1024 --ff 512 \
	  --tokenizer-json vocab/qwen3/tokenizer.json -o $(SERVE_FIXTURE)
	$(BUILD)/tools/moegraph_serve_bench -m $(SERVE_FIXTURE) --benchmark_min_time=2

# The oracle's greedy tokens against llama.cpp's (node-llama-cpp's prebuilt CPU
# binary, installed from npm into tools/llama-crosscheck/node_modules).
crosscheck: build
	tools/llama-crosscheck/run.sh $(BUILD)

# The CPU backend's speed beside llama.cpp's CPU build: pp512 and tg64 at 1 and 2
# threads on two fixtures (minutes; docs/BENCHMARKS.md has its table).
crosscheck-speed: build
	tools/llama-crosscheck/cpu-speed.sh $(BUILD)

clean:
	rm -rf $(BUILD) $(FUZZ_BUILD) $(EMU_BUILD)
