"""One engine, one precision, one process, 2 threads: prefill ms, decode tokens/s, and optionally logits.

    python engine.py ENGINE PRECISION --models DIR [--prompt-tokens 128 --new-tokens 64 --repeats 5]
                     [--logits-out FILE.npy] [--greedy-out FILE.json]

Prints one JSON line. The prompt is the first --prompt-tokens ids of DIR/seq.npy (prepare.py). One greedy run
(prefill, then --new-tokens single-token steps feeding the argmax, EOS ignored) warms up and gives the greedy
ids; then --repeats timed runs: prefill_ms = prompt -> first logits, decode_tok_s = new tokens / time of the
single-token steps (prefill excluded); medians and every repeat are printed. rss_mb: the process's resident
memory after the runs; rss_delta_mb: that minus its resident memory once the engine's library (torch,
llama_cpp, ...) was imported, before the model was loaded: what the loaded and run model adds.
--logits-out saves the logits of every position of DIR/seq.npy, (T, vocab) float32, in one forward pass.

Engines and precisions (ENGINES below); gpt2ffn and hf run under gpt2ffn's venv (/work/main/.venv), the
others under the peer venv (setup.sh).
"""

import argparse
import json
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

THREADS = 2
LIBRARIES = {"gpt2ffn": ("torch", "gpt2ffn.generate"), "hf": ("torch", "transformers"), "ort": ("onnxruntime",),
             "llama": ("llama_cpp",), "ct2": ("ctranslate2",)}  # imported before the baseline RSS


def rss_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Stepper:
    """An engine as two calls: prefill(ids) -> last logits (fresh state), step(token) -> next logits."""

    def greedy(self, prompt, n):
        """(prefill seconds, decode seconds, n greedy ids). The first id comes from the prefill; n single-token
        steps follow (the last one's id is dropped), so the decode time covers as many steps as new tokens."""
        t0 = time.perf_counter()
        logits = self.prefill(prompt)
        t1 = time.perf_counter()
        ids = [int(np.argmax(logits))]
        for _ in range(n):
            ids.append(int(np.argmax(self.step(ids[-1]))))
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, ids[:n]


class Torch(Stepper):
    def __init__(self):
        import torch
        torch.set_num_threads(THREADS)
        self.torch = torch

    def run(self, fn, *args):
        with self.torch.inference_mode():
            return fn(*args)


class Gpt2ffn(Torch):
    """gpt2ffn's GPT2 (generate.load, precision=), KV cache, last-position logits, as generate.stream drives it."""
    precisions = ("fp32", "bf16", "int8", "int4")

    def __init__(self, precision, models, max_len):
        super().__init__()
        from gpt2ffn.generate import load
        from gpt2ffn.serving.kv_cache import KVCache
        try:
            self.model, _, _ = load(str(models / "hf"), precision=precision)
        except TypeError:  # before load() had precision=
            if precision != "fp32":
                raise
            self.model, _, _ = load(str(models / "hf"))
        self.KVCache, self.max_len = KVCache, max_len

    def prefill(self, prompt):
        dtype = getattr(self.model, "kv_dtype", self.torch.float32)  # fp16 for bf16/int8/int4 since it exists
        self.cache = self.KVCache(self.model.config, 1, dtype, max_len=self.max_len)
        ids = self.torch.tensor([prompt])
        return self.run(self.model, ids, self.cache, None, True)[0, -1].numpy()

    def step(self, token):
        return self.run(self.model, self.torch.tensor([[token]]), self.cache, None, True)[0, -1].numpy()

    def logits(self, seq):
        return self.run(self.model, self.torch.tensor([seq]))[0].float().numpy()


class HF(Torch):
    """transformers GPT2LMHeadModel, fp32, sdpa attention, its own KV cache: the fp32 reference."""
    precisions = ("fp32",)

    def __init__(self, precision, models, max_len):
        super().__init__()
        from transformers import GPT2LMHeadModel
        self.model = GPT2LMHeadModel.from_pretrained(models / "hf", attn_implementation="sdpa").eval()

    def prefill(self, prompt):
        out = self.run(self.model, self.torch.tensor([prompt]))
        self.past = out.past_key_values
        return out.logits[0, -1].numpy()

    def step(self, token):
        out = self.run(lambda: self.model(self.torch.tensor([[token]]), past_key_values=self.past))
        self.past = out.past_key_values
        return out.logits[0, -1].numpy()

    def logits(self, seq):
        return self.run(lambda: self.model(self.torch.tensor([seq]), use_cache=False).logits[0].numpy())


class ORT(Stepper):
    """ONNX Runtime on optimum's text-generation-with-past export: a raw InferenceSession loop over the
    model's own input / output names (past_key_values.N.key -> present.N.key). int8: quantize_dynamic (one
    scale per tensor); q8_0 / q4_0: MatMulNBits, blocks of 32 on both sides (prepare.py)."""
    precisions = ("fp32", "int8", "q8_0", "q4_0")

    def __init__(self, precision, models, max_len):
        import onnxruntime as ort
        so = ort.SessionOptions()
        so.intra_op_num_threads, so.inter_op_num_threads = THREADS, 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.sess = ort.InferenceSession(str(models / f"onnx-{precision}/model.onnx"), so,
                                         providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.sess.get_inputs()]
        self.outputs = [o.name for o in self.sess.get_outputs()]
        self.pasts = [n for n in self.inputs if n.startswith("past_key_values.")]
        kv = self.sess.get_inputs()[self.inputs.index(self.pasts[0])].shape  # [batch, heads, past, head_dim]
        self.empty = np.zeros((1, kv[1], 0, kv[3]), np.float32)

    def forward(self, ids):
        """ids (1, T) after self.n cached positions -> logits (1, T, vocab); updates the cache."""
        T = ids.shape[1]
        feed = {"input_ids": ids, "attention_mask": np.ones((1, self.n + T), np.int64)}
        if "position_ids" in self.inputs:
            feed["position_ids"] = np.arange(self.n, self.n + T, dtype=np.int64)[None]
        feed.update(zip(self.pasts, self.past))
        out = self.sess.run(self.outputs, feed)
        self.past, self.n = out[1:], self.n + T  # outputs: logits, then present.N.key/value in input order
        return out[0]

    def reset(self):
        self.past, self.n = [self.empty] * len(self.pasts), 0

    def prefill(self, prompt):
        self.reset()
        return self.forward(np.array([prompt], np.int64))[0, -1]

    def step(self, token):
        return self.forward(np.array([[token]], np.int64))[0, -1]

    def logits(self, seq):
        self.reset()
        return self.forward(np.array([seq], np.int64))[0]


class Llama(Stepper):
    """llama.cpp through llama-cpp-python: Llama.eval one token at a time, argmax of the last logits row
    (no sampler, so EOS is never special). logits_all only for the accuracy pass: it costs prefill time."""
    precisions = ("f32", "bf16", "q8_0", "q4_0")

    def __init__(self, precision, models, max_len):
        from llama_cpp import Llama as L
        self.path = str(models / f"gguf/gpt2-{precision}.gguf")
        self.llm = L(self.path, n_ctx=max_len, n_batch=max_len, n_ubatch=max_len, n_threads=THREADS,
                     n_threads_batch=THREADS, logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def last(self):
        # Without logits_all, Llama.eval keeps no scores: the context holds the last position's row only.
        return np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))

    def prefill(self, prompt):
        self.llm.reset()
        self.llm.eval(prompt)
        return self.last()

    def step(self, token):
        self.llm.eval([token])
        return self.last()

    def logits(self, seq):
        from llama_cpp import Llama as L
        n = len(seq)
        full = L(self.path, n_ctx=n, n_batch=n, n_ubatch=n, n_threads=THREADS, n_threads_batch=THREADS,
                 logits_all=True, verbose=False)
        full.eval(list(seq))
        return np.array(full.scores[:n], np.float32)


class CT2(Stepper):
    """CTranslate2 Generator: generate_tokens greedy (sampling_topk=1); min_length keeps EOS from stopping
    it (CT2 masks the end token below min_length, the only way it offers to ignore EOS)."""
    precisions = ("float32", "int8", "bfloat16")
    MODEL = {"float32": "ct2-float32", "int8": "ct2-int8", "bfloat16": "ct2-float32"}

    def __init__(self, precision, models, max_len):
        import ctranslate2
        self.gen = ctranslate2.Generator(str(models / self.MODEL[precision]), device="cpu", compute_type=precision,
                                         intra_threads=THREADS, inter_threads=1)
        self.tokens = json.loads((models / self.MODEL[precision] / "vocabulary.json").read_text())  # id -> str

    def greedy(self, prompt, n):
        it = self.gen.generate_tokens([self.tokens[i] for i in prompt], max_length=n + 1, min_length=n + 1,
                                      sampling_topk=1)
        t0 = time.perf_counter()
        ids = [next(it).token_id]
        t1 = time.perf_counter()
        ids += [r.token_id for r in it]
        t2 = time.perf_counter()
        if len(ids) != n + 1:
            raise RuntimeError(f"ctranslate2 generated {len(ids)} tokens, expected {n + 1}")
        return t1 - t0, t2 - t1, ids[:n]

    def logits(self, seq):
        return np.array(self.gen.forward_batch([[self.tokens[i] for i in seq]]), np.float32)[0]


ENGINES = {"gpt2ffn": Gpt2ffn, "hf": HF, "ort": ORT, "llama": Llama, "ct2": CT2}
DISTRIBUTIONS = {"gpt2ffn": ("gpt2ffn", "torch"), "hf": ("transformers", "torch"), "ort": ("onnxruntime",),
                 "llama": ("llama_cpp_python",), "ct2": ("ctranslate2",)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engine", choices=ENGINES)
    ap.add_argument("precision")
    ap.add_argument("--models", type=Path, default=Path("/work/peers-build/models"))
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs after the warm-up (0: none)")
    ap.add_argument("--logits-out", type=Path, help="save (T, vocab) float32 logits over DIR/seq.npy")
    ap.add_argument("--greedy-out", type=Path, help="save the greedy ids as JSON")
    args = ap.parse_args()
    cls = ENGINES[args.engine]
    if args.precision not in cls.precisions:
        sys.exit(f"engine {args.engine} has no precision {args.precision!r}; known: {', '.join(cls.precisions)}")
    seq = np.load(args.models / "seq.npy").tolist()
    prompt = seq[:args.prompt_tokens]

    import importlib
    for lib in LIBRARIES[args.engine]:
        importlib.import_module(lib)
    rss0 = rss_bytes()
    t = time.perf_counter()
    engine = cls(args.precision, args.models, args.prompt_tokens + args.new_tokens + 1)
    out = {"engine": args.engine, "precision": args.precision, "load_s": time.perf_counter() - t,
           "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "threads": THREADS,
           "versions": {d: version(d) for d in DISTRIBUTIONS[args.engine]}}
    _, _, ids = engine.greedy(prompt, args.new_tokens)  # warm-up
    out["greedy_distinct"] = len(set(ids))
    runs = [engine.greedy(prompt, args.new_tokens) for _ in range(args.repeats)]
    if runs:
        prefill = [p * 1e3 for p, _, _ in runs]
        decode = [args.new_tokens / d for _, d, _ in runs]
        out.update(prefill_ms=statistics.median(prefill), decode_tok_s=statistics.median(decode),
                   prefill_ms_all=prefill, decode_tok_s_all=decode,
                   greedy_stable=all(r[2] == ids for r in runs))
    out.update(rss_mb=rss_bytes() / 1e6, rss_delta_mb=(rss_bytes() - rss0) / 1e6)
    if args.greedy_out:
        args.greedy_out.write_text(json.dumps(ids))
    if args.logits_out:
        logits = engine.logits(seq)
        np.save(args.logits_out, logits.astype(np.float32))
        out["logits_shape"] = list(logits.shape)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
