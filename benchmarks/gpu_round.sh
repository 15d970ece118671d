#!/usr/bin/env bash
# One round of issue 18's checks on a lent GPU, in one device call (../shared/gpu/README.md: run
# `bash ../shared/gpu/wheels.sh` here once, then `run` with carry [".whl"] and the command
# `bash benchmarks/gpu_round.sh`). Everything lands in $OUT:
#   gpu.txt          the card, driver, torch and CUDA versions
#   cuda-tests.txt   the tests marked cuda (model, engine, CUDA graphs against eager and HF)
#   bench-model.json / bench.txt   gpt2ffn bench --model --device cuda: batch 1, 32, 256, bf16 and fp32,
#                    against HF generate (eager; static cache up to batch 32), graph capture time
#   load-cuda.json / load.txt      benchmarks/load_test.py against gpt2ffn serve --device cuda at 1, 32, 256
#                    streaming clients (tokens/s, TTFT and latency p50/p99, errors)
#   bench-cuda.json / ffn.txt      the FFN alone (fp32, d=768) at 1, 64, 4096 tokens: ours (the cuBLASLt GELU
#                    epilogue where kernels/cuda.py checks and picks it) vs Linear+GELU+Linear, torch.compile,
#                    the epilogue alone and the two bare GEMMs
# Each part has its own time limit, so a hang in one still brings the others back.
set -u
OUT=${OUT:-/tmp/gpu-round}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
} > "$OUT/gpu.txt" 2>&1
timeout 240 python3 -m pytest -q -m cuda -p no:cacheprovider tests/ > "$OUT/cuda-tests.txt" 2>&1
timeout 300 python3 -m gpt2ffn.cli bench --model --device cuda --precision bf16 --precision fp32 \
  --out "$OUT" > "$OUT/bench.txt" 2>&1
timeout 200 python3 -m gpt2ffn.cli bench --device cuda --dims 768 --tokens 1,64,4096 --out "$OUT" \
  > "$OUT/ffn.txt" 2>&1
timeout 300 python3 benchmarks/load_test.py --hf-dir random:gpt2 --device cuda --max-batch 256 \
  --clients 1,32,256 --requests-per-client 2 --max-tokens 64 --out "$OUT/load-cuda.json" > "$OUT/load.txt" 2>&1
tail -n 5 "$OUT"/*.txt
