"""Why `serve --device cuda`'s greedy answer can differ from the in-process one (tests/test_server.py's cuda test):
the tiny random checkpoint the test serves, bf16 on the GPU, greedy tokens of one prompt through each path that
could differ, with the top-two logit margin of each step (a margin of 0 is a tie that rounding decides):

    generate          gpt2ffn.generate (a 15-position slot, graphs captured on first use, bursts)
    server-like       Engine as serve makes it (128-position slots, graphs at start-up, max batch 64)
    no bursts         generate, every step through the sampler
    packed prefill    generate, the prompt packed under a mask
    plain FFN         generate, c_fc + GELU + c_proj as three ops (GPT2FFN_CUDA_FFN=plain's path)
    batch-invariant   generate(batch_invariant=True): each row alone (on CUDA the one-row graph in its slot)
    served            the same prompt through `gpt2ffn serve --device cuda` and HTTP

    PYTHONPATH=src python benchmarks/gpu_server_diag.py
"""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from gpt2ffn import Config
from gpt2ffn.generate import Sampling, engine_for, generate, load
from gpt2ffn.kernels import cuda as cuda_ffn
from gpt2ffn.model import random_weights_
from gpt2ffn.serving import static
from gpt2ffn.serving.engine import Engine, Request


def checkpoint(d: Path) -> Path:
    """tests/test_server.py's model_dir: the tiny config, random weights (seed 0), a BPE tokenizer trained here."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
    cfg = Config.from_name("tiny")
    random_weights_(GPT2LMHeadModel(GPT2Config(**cfg.to_hf_dict())), 0).save_pretrained(d)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog. Hello world!"] * 40, vocab_size=320,
                            special_tokens=["<|endoftext|>"])
    tok.save(str(d / "tokenizer.json"))
    PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>").save_pretrained(d)
    return d


DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"


def margins(model, ids: list, out: list) -> list:
    """Top-two logit margin at each generated position, from one plain forward of the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + out], device=DEVICE))[0, len(ids) - 1:-1].float()
    top = logits.topk(2, -1).values
    return [round(x, 5) for x in (top[:, 0] - top[:, 1]).tolist()]


def main():
    d = checkpoint(Path(tempfile.mkdtemp()) / "tiny-gpt2")
    _, tok, _ = load(str(d))
    model = load(str(d), device=DEVICE)[0].eval()
    ids = tok.encode("the quick brown")
    eos = model.config.eos_token_id
    s = Sampling(max_new_tokens=12, eos_token_id=eos)
    s_all = Sampling(max_new_tokens=12)
    got = {}
    got["generate"] = generate(model, [ids], s_all)[0]
    e = Engine(model, max_batch=64, max_len=128)
    got["server-like"] = e.run([Request(list(ids), s_all)])[0].output
    static.MAX_BURST = 0
    got["no bursts"] = generate(model, [ids], s_all)[0]
    static.MAX_BURST = 8
    eng = engine_for(model, [ids], s_all)
    eng.fresh_prefill = False
    got["packed prefill"] = eng.run([Request(list(ids), s_all)])[0].output
    cuda_ffn.FORCED = "plain"
    got["plain FFN"] = generate(model, [ids], s_all)[0]
    cuda_ffn.FORCED = None
    got["batch-invariant"] = generate(model, [ids], s_all, batch_invariant=True)[0]
    print("FFN choices:", cuda_ffn.choices())
    from gpt2ffn.kernels import plain
    mlp = model.transformer.h[0].mlp
    w1, b1, w2, b2 = mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias
    for n in (1, 3, 64):
        x = torch.randn(n, w1.shape[0], device=DEVICE, dtype=w1.dtype)
        want = plain(x.float(), w1.float(), b1.float(), w2.float(), b2.float(), "tanh")
        for name, f in (("plain", lambda x=x: plain(x, w1, b1, w2, b2, "tanh")),
                        ("fused", lambda x=x: cuda_ffn.fused(x, w1, b1, w2, b2))):
            print(f"FFN {name:<6} {n:>3} tokens, {w1.dtype}: max |err| vs fp32 {(f().float() - want).abs().max():.4f}")
    port = 18765
    proc = subprocess.Popen([sys.executable, "-m", "gpt2ffn.cli", "serve", "--model", str(d), "--port", str(port),
                             "--device", DEVICE], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "tiny-gpt2", "prompt": ids, "max_tokens": 12, "temperature": 0,
                             "ignore_eos": True, "return_token_ids": True}).json()
        got["served"] = r["choices"][0].get("token_ids") or tok.encode(r["choices"][0]["text"])
        print("served response:", r["choices"][0])
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"prompt ids {ids}, eos {eos}")
    for k, v in got.items():
        print(f"{k:<16} {v}   margins {margins(model, ids, v)}")
    print("generate with EOS:", generate(model, [ids], s)[0])


if __name__ == "__main__":
    main()
