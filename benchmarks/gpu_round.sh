#!/usr/bin/env bash
# Issue 18's checks on a lent GPU, in two device calls of under 10 minutes each (../shared/gpu/README.md: run
# `bash ../shared/gpu/wheels.sh` here once, then `run` with carry [".whl"] and the command
#   bash benchmarks/gpu_round.sh tests bench      then      bash benchmarks/gpu_round.sh ffn load
# The serve extra's httptools (uvicorn's C HTTP parser; the image has uvloop) is not in wheels.sh's list: add it to
# .whl with README's device download line (`... -d .whl httptools==0.9.0`), or uvicorn parses HTTP in Python (h11).
# Each part has its own time limit, so a hang in one still brings the others back. Everything lands in $OUT:
#   gpu.txt          the card, driver, torch, CUDA and transformers versions
#   tests: cuda-tests.txt    the tests marked cuda (model, engine, CUDA graphs against eager and HF, the FFN)
#   tests: CUDA_TESTS names the test files (default: all of tests/)
#   bench: bench-model.json, bench.txt    gpt2ffn bench --model --device cuda: batch 1, 32, 256, bf16 and fp32
#                    (BENCH_DTYPES="bf16": bf16 only), against HF generate (eager; static cache up to batch 32),
#                    graph capture time
#   ab:    engine-ab-cuda.json, ab.txt    benchmarks/gpu_engine_ab.py: the engine's prefill (packed, padded
#                    batches, 2048 to 32768 tokens a step) and decode bursts (0, 1, 8, 16 steps) side by side, bf16
#   kernels: kernels-{before,after}.json, kernels{,-after}.txt   bench --model bf16 at batch 1 and 32 without
#                    (GPT2FFN_ADD_NORM=0, GPT2FFN_DECODE_BLOCK=default) and with the fused add + layer norm and
#                    the chosen decode configuration, one after the other (the two HF rows show the drift)
#   diag:  diag.txt   benchmarks/gpu_server_diag.py: one greedy prompt of the server test's tiny checkpoint through
#                    every path that could differ (generate, server-like engine, bursts, prefill, FFN, serve)
#   ffn:   bench-cuda.json, ffn.txt       the FFN alone (fp32 and bf16, d=768) at 1, 4096, 65536 tokens: ours
#                    (the cuBLASLt GELU epilogue or the Triton kernel where kernels/cuda.py picks them) vs
#                    Linear+GELU+Linear, torch.compile,
#                    the epilogue alone and the two bare GEMMs
#   load:  load-cuda.json, load.txt       benchmarks/load_test.py against gpt2ffn serve --device cuda at 1, 32
#                    and 256 streaming clients (tokens/s, TTFT and latency p50/p99, errors), 8 client processes
#   overhead: serve-overhead-cuda.json, overhead.txt   benchmarks/serve_overhead.py: 256 streaming clients against
#                    the same 256 requests in process (issue 18's >= 0.7 target), CPU us per token of the event
#                    loop and the engine thread (a third call: `bash benchmarks/gpu_round.sh overhead sampling`)
#   overhead4: serve-overhead-cuda-interval-4.json, overhead4.txt   the same with serve --stream-interval 4
#   procs: serve-overhead-cuda-processes.json, procs.txt   the same, 4 servers interleaved: the engine in a thread of
#                    the server (--engine-process off), in its own process (on, CUDA's default), and that behind 2
#                    and 4 API processes (--api-servers); issue 18's 0.7 is for the best of them
#   sampling: sampling-host-cuda.json, sampling.txt   benchmarks/sampling_host.py --device cuda: the batch sampler
#                    against the per-row loop at batch 256 (GPT-2's vocabulary), aten ops per call, engine steps
#   attention: attention-cuda.json, attention.txt   benchmarks/gpu_attention.py: one layer's decode attention at batch
#                    1/32/256 and cache 192/1024: the SDPA path under a mask against the Triton kernel
#   invariant: load-invariant-cuda.json, invariant.txt   load_test.py --batch-invariant at 1 and 32 clients: every
#                    answer should equal the same request alone ("differ from alone 0"), issue 18's promise
#   profile: profile-cuda.json, profile.txt   benchmarks/gpu_profile.py: torch.profiler over the engine's bf16 run at
#                    batch 1 and 256 (host time against kernel time, the top ops of each)
# With 15 minutes of device time (all calls together, ~30 s to start each), the parts' limits shrink: T=short
#   (tests 150 s, bench 160, ab 90, kernels 2 x 120, diag 90, ffn 150, load 120, overhead 150, invariant 90, profile
#   60; a call may run 600). On an H200: `tests ffn bench overhead invariant` took 310 s (its tests then had 60 s,
#   too few for all of them), `tests ab bench overhead profile` with CUDA_TESTS naming three files and
#   BENCH_DTYPES=bf16 230 s, `diag ab bench` (BENCH_DTYPES=bf16) 145 s; on 2026-11-27 `tests bench overhead overhead4
#   invariant ffn` with CUDA_TESTS naming the six files that hold cuda tests and BENCH_DTYPES=bf16 412 s (its tests 68
#   s). What the next GPU should run first (not yet run there: the engine's own process and the API processes in
#   front of it, the cuda tests of the server since, the profile since the fused add + layer norm and the wide decode
#   configuration, and the two apart):
#     T=short CUDA_TESTS="tests/test_server.py tests/test_serving.py" bash benchmarks/gpu_round.sh procs tests
#     T=short bash benchmarks/gpu_round.sh kernels profile ab
# The .json and .png files go back in one results.tar (the device tool brings back 8 files at most).
set -u
usage="usage: $0 {tests,bench,ab,kernels,diag,ffn,load,overhead,overhead4,procs,sampling,attention,invariant,"
usage+="profile}..."
[ $# -gt 0 ] || { echo "$usage" >&2; exit 2; }
OUT=${OUT:-/tmp/gpu-round}
limit() {  # limit PART LONG SHORT: the part's time limit in seconds
  if [ "${T:-}" = short ]; then echo "$3"; else echo "$2"; fi
}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, transformers as t; print('torch', torch.__version__, 'cuda', torch.version.cuda,
    'transformers', t.__version__)"
} > "$OUT/gpu.txt" 2>&1
pack() {  # the parts' .json and .png into results.tar as each part ends (8 files come back at most)
  (cd "$OUT" && shopt -s nullglob && f=(*.json *.png) && { [ ${#f[@]} -eq 0 ] || { tar rf results.tar "${f[@]}" &&
    rm -f "${f[@]}"; }; })
}
run() {  # run PART LONG SHORT LOG CMD...: CMD under the part's time limit, its output into $OUT/LOG
  local lim=$(limit "$1" "$2" "$3") log=$4
  shift 4
  timeout "$lim" "$@" > "$OUT/$log" 2>&1
}
for part in "$@"; do
  case $part in
    tests) run tests 300 150 cuda-tests.txt python3 -m pytest -q -m cuda -p no:cacheprovider ${CUDA_TESTS:-tests/} ;;
    bench) run bench 330 160 bench.txt python3 -m gpt2ffn.cli bench --model --device cuda \
             $(for p in ${BENCH_DTYPES:-bf16 fp32}; do echo --precision "$p"; done) --out "$OUT" ;;
    diag) run diag 120 90 diag.txt python3 benchmarks/gpu_server_diag.py ;;
    kernels) run kernels 240 120 kernels.txt env GPT2FFN_ADD_NORM=0 GPT2FFN_DECODE_BLOCK=default \
               python3 -m gpt2ffn.cli bench --model --device cuda --precision bf16 --batch 1 --batch 32 --out "$OUT" &&
               mv "$OUT/bench-model.json" "$OUT/kernels-before.json"
             run kernels 240 120 kernels-after.txt python3 -m gpt2ffn.cli bench --model --device cuda --precision bf16 \
               --batch 1 --batch 32 --out "$OUT" && mv "$OUT/bench-model.json" "$OUT/kernels-after.json" ;;
    ab) run ab 200 90 ab.txt python3 benchmarks/gpu_engine_ab.py --device cuda --out "$OUT/engine-ab-cuda.json" ;;
    ffn) run ffn 300 150 ffn.txt python3 -m gpt2ffn.cli bench --device cuda --dims 768 --tokens 1,4096,65536 \
           --out "$OUT" ;;
    load) run load 330 120 load.txt python3 benchmarks/load_test.py --hf-dir random:gpt2 --device cuda \
            --max-batch 256 --clients 1,32,256 --requests-per-client 2 --max-tokens 64 --processes 8 \
            --out "$OUT/load-cuda.json" ;;
    overhead) run overhead 400 150 overhead.txt python3 benchmarks/serve_overhead.py --model random:gpt2 \
                --device cuda --clients 256 --max-tokens 64 --rounds 2 --out "$OUT/serve-overhead-cuda.json" ;;
    procs) run procs 560 300 procs.txt python3 benchmarks/serve_overhead.py --model random:gpt2 \
             --device cuda --clients 256 --max-tokens 64 --rounds 2 --serve "engine thread=--engine-process off" \
             --serve "engine process=--engine-process on" --serve "2 API processes=--api-servers 2" \
             --serve "4 API processes=--api-servers 4" --out "$OUT/serve-overhead-cuda-processes.json" ;;
    overhead4) run overhead 400 150 overhead4.txt python3 benchmarks/serve_overhead.py --model random:gpt2 \
                 --device cuda --clients 256 --max-tokens 64 --rounds 2 --stream-interval 4 \
                 --out "$OUT/serve-overhead-cuda-interval-4.json" ;;
    sampling) run sampling 150 90 sampling.txt python3 benchmarks/sampling_host.py --device cuda --rounds 5 \
                --out "$OUT/sampling-host-cuda.json" ;;
    attention) run attention 120 60 attention.txt python3 benchmarks/gpu_attention.py \
                 --out "$OUT/attention-cuda.json" ;;
    invariant) run invariant 200 90 invariant.txt python3 benchmarks/load_test.py --hf-dir random:gpt2 \
                 --device cuda --batch-invariant --max-batch 32 --clients 1,32 --requests-per-client 2 \
                 --max-tokens 32 --processes 4 --out "$OUT/load-invariant-cuda.json" ;;
    profile) run profile 150 60 profile.txt python3 benchmarks/gpu_profile.py --device cuda --batch 1 256 \
               --out "$OUT/profile-cuda.json" ;;
    *) echo "unknown part $part" >&2 ;;
  esac
  pack
done
tail -n 12 "$OUT"/*.txt
