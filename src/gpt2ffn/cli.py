"""The `gpt2ffn` command: one subcommand per task, each mapped to a function. Errors print one line, exit 2."""

import argparse
import math
import os
import re
import sys
import warnings
from pathlib import Path

from .config import GPT_CONFIG_124M
from .errors import Gpt2ffnError, warning_line
from .precision import PRECISIONS


class UsageError(Gpt2ffnError):
    """A command-line mistake."""


class Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(f"{self.prog}: {message}")


def cmd_demo(args):
    """Seed 000's example, then the numpy reference on the same weights."""
    import torch

    from . import reference
    from .ffn import FeedForward
    from .gelu import GELU

    torch.manual_seed(123)
    ff = FeedForward(GPT_CONFIG_124M).eval()
    x = torch.randn(2, 3, GPT_CONFIG_124M["emb_dim"])
    with torch.no_grad():
        output = ff(x)
    print(f"Config: n_embd={ff.config.n_embd}, hidden={ff.config.hidden}, "
          f"activation_function={ff.config.activation_function!r} (tanh GELU, as GPT-2)")
    print(f"Input shape:  {x.shape}")
    print(f"Output shape: {output.shape}")
    assert output.shape == x.shape
    print("✓ Shape preservation test passed!")
    vals = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0])
    print("GELU test values:", vals)
    print("GELU outputs:    ", GELU()(vals))
    ref = reference.FFN.from_state_dict(ff.state_dict()).forward(x.numpy())
    diff = float(abs(ref - output.numpy()).max())
    print(f"numpy reference (gpt2ffn.reference) vs torch module: max |diff| = {diff:.2e}")
    return 0


def cmd_gelu(args):
    """Both GELU forms at the given points, or a plot of them."""
    import numpy as np

    from .reference import gelu_exact, gelu_tanh

    if args.plot:
        from .plot import plot_gelu
        plot_gelu(args.plot)
        print(f"wrote {args.plot}")
        if not args.x:
            return 0
    if not args.x:
        raise UsageError("gpt2ffn gelu: give one or more numbers, or --plot FILE")
    x = np.array(args.x, dtype=np.float64)
    if not np.isfinite(x).all():
        raise UsageError(f"gpt2ffn gelu: give finite numbers, got {next(v for v in args.x if not np.isfinite(v))}")
    with np.errstate(over="ignore"):  # x^3 overflows past 1e102; the tanh form still gives x there
        tanh, exact = gelu_tanh(x), gelu_exact(x)

    def num(v, width, digits):  # fixed point, or an exponent where fixed point would run past the column
        return f"{v:>{width}.{digits}f}" if abs(v) < 1e6 else f"{v:>{width}.{digits}e}"

    print(f"{'x':>10} {'tanh (GPT-2)':>14} {'exact (erf)':>14} {'exact - tanh':>14}")
    for row in zip(x, tanh, exact, exact - tanh):
        print(f"{num(row[0], 10, 4)} {num(row[1], 14, 7)} {num(row[2], 14, 7)} {row[3]:>14.3e}")
    return 0


def _ids(text):
    parts = text.split(",")
    try:
        ids = [int(t) for t in parts if t.strip()]
    except ValueError:
        ids = None
    if ids is None or len(ids) != len(parts) and text.strip():  # 1,,2: a missing id, not 1,2
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 15496,11,616, got {text!r}")
    return ids


def _at_least(least: int):
    def check(text):
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < least:
            raise argparse.ArgumentTypeError(f"an int >= {least}, got {text!r}")
        return n
    return check


def _counts(text):
    """Comma-separated positive ints (--dims, --tokens)."""
    try:
        out = _ids(text)
    except argparse.ArgumentTypeError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints like 1,64,2048, got {text!r}")
    return out


def _port(text):
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is an int in [0, 65535], got {text!r}")
    return port


PLOT_FORMATS = (".png", ".pdf", ".svg")


def _plot_file(text):
    """--plot's file: named, not a directory, a format matplotlib writes (no suffix: .png, said as written)."""
    path = Path(text)
    if not text.strip():
        raise argparse.ArgumentTypeError("give a file name, e.g. --plot gelu.png")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file in it, e.g. {path / 'plot.png'}")
    if not path.suffix:
        return str(path) + ".png"
    if path.suffix.lower() not in PLOT_FORMATS:
        raise argparse.ArgumentTypeError(f"{text}: write {', '.join(PLOT_FORMATS)}, not {path.suffix}")
    return text


def _out_dir(text):
    """A directory to write into: named (an empty string would write into the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("give a directory, e.g. --out golden")
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; give a directory")
    return text


def _tol(text):
    key, _, value = text.partition("=")
    try:
        return key, _atol(value)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected CHECKPOINT=ATOL like 09=1e-3 or ffn=2e-4 (ATOL a number >= 0), "
                                         f"got {text!r}") from None


def _atol(text):
    """A tolerance: a finite number >= 0 (a NaN or negative one would fail every tensor, a correct one too)."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"a tolerance is a finite number >= 0, got {text!r}")
    return value


def cmd_extract(args):
    """Golden tensors from HF's own GPT-2 modules."""
    from .golden import Golden, extract
    m = extract(args.model, args.out, ids=args.ids, prompt=args.prompt, layers=args.layers,
                progress=not args.quiet, file_format=args.format)
    n, aliases = (sum((e["kind"] == "alias") == a for e in m["tensors"].values()) for a in (False, True))
    how = {"npy": ".npy files", "bin": "raw float32 .bin files", "safetensors": "golden.safetensors"}[args.format]
    print(f"wrote {n} tensors{f' (and {aliases} under seed 001 names)' if aliases else ''} for "
          f"{len(m['token_ids'])} tokens, layers {m['layers']}, "
          f"from {m['model']['source']} to {args.out} ({how}, manifest.json)")
    if m["layers"] and (weak := Golden(args.out).weak_note()):
        print(weak)
    return 0


def strict_json(obj):
    """obj with every NaN or infinite float as None: JSON has no NaN (Python writes a bare NaN, which JSON.parse,
    serde_json and jq refuse); a row not measured has a max abs of null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def cmd_verify(args):
    """Judge gpt2ffn (or --candidate's tensors) against a golden directory."""
    import json

    from . import golden as g

    if args.plot and not Path(args.plot).resolve().parent.is_dir():  # before the run, not after it
        raise UsageError(f"gpt2ffn verify: --plot {args.plot}: no directory {Path(args.plot).parent} to write it in")
    gold = g.Golden(args.golden)
    tolerances = dict(args.tol)
    known = set(gold.tensors) | {e["stage"] for e in gold.tensors.values()} | set(g.CHECKPOINTS)
    for key, value in tolerances.items():
        if key not in known:
            raise Gpt2ffnError(f"--tol {key}={value:g}: {key!r} names no tensor, stage or checkpoint of {args.golden} "
                               "(a tensor as h0_ffn, a stage of every block as ffn, or a checkpoint as 06 for c_fc, "
                               "GELU and the FFN output)")
    cand = g.Candidate(args.candidate) if args.candidate else None
    notes = []  # said after the table: what was not judged, and why
    if cand is not None:
        names, hint = g.unmatched(gold, cand)
        if names:
            notes.append(f"not judged: {len(names)} candidate tensor{'s match' if len(names) > 1 else ' matches'} "
                         f"no golden name: {', '.join(names[:6])}{', ...' if len(names) > 6 else ''} ({hint})")
        if cand.keys is None and not cand.names() and (inner := sorted(cand.path.glob("*.safetensors"))):
            notes.append(f"{cand.path} holds {inner[0].name}: pass the file itself, --candidate {inner[0]}")
        if cand.keys is None and cand.names():  # files the judge reads beside files it does not
            other = sorted(p.name for p in cand.path.iterdir() if p.is_file() and p.suffix not in (".npy", ".bin")
                           and (p.stem in gold.tensors or p.suffix == ".safetensors"))
            if other:
                notes.append(f"not read: {', '.join(other[:4])}{', ...' if len(other) > 4 else ''}: a candidate "
                             "directory's tensors are NAME.npy or NAME.bin (raw little-endian float32); a "
                             ".safetensors file is passed alone, as --candidate FILE.safetensors")
        if cand.path.resolve() == gold.dir.resolve() or cand.path.resolve() == (gold.dir / g.BUNDLE).resolve():
            notes.append("the candidate is the golden set itself: it passes by construction")
        if gold.layers and (weak := gold.weak_note(args.atol)):
            notes.append(weak)
    if args.negative:
        rows, title = g.verify_negative(gold, args.atol), "negative controls: each known-wrong FFN must FAIL"
    elif cand:
        rows, title = g.verify_candidate(gold, cand, tolerances, args.atol), f"candidate {args.candidate}"
    else:
        rows, title = g.verify_ours(gold, tolerances, args.atol, args.repeat), "gpt2ffn's own implementation"
    failed = [r for r in rows if r.status == "FAIL" or (args.strict and r.status == "MISSING")]
    judged = [r for r in rows if r.status not in ("MISSING", "SKIP")]
    first = failed[0] if failed else None
    if first is not None and first.layer is not None and any("look 1-based" in n for n in notes):
        first.note = "; ".join(t for t in (first.note, "the candidate's layer names look 1-based (see above): its "
                                           "h1_ is GPT-2's h0_, so each block is judged against the next one's "
                                           "golden tensors") if t)
    if args.json:
        counts = {k.lower(): sum(r.status == k for r in rows) for k in ("PASS", "FAIL", "MISSING", "SKIP")}
        print(json.dumps(strict_json({"golden": str(args.golden), "mode": title, "passed": not failed and bool(judged),
                                      "counts": counts, "first_failure": first.as_dict() if first else None,
                                      "notes": notes, "rows": [r.as_dict() for r in rows]}), indent=1))
    else:
        print(g.format_rows(rows, f"{title} vs golden {args.golden} ({gold.manifest['model']['source']}, "
                                  f"{len(gold.token_ids)} tokens)"))
        missing = sum(r.status == "MISSING" for r in rows)
        skipped = sum(r.status == "SKIP" for r in rows)
        print(f"\n{len(judged) - len([r for r in judged if r.status == 'FAIL'])} passed, "
              f"{sum(r.status == 'FAIL' for r in rows)} failed" + (f", {missing} missing" if missing else "")
              + (f", {skipped} skipped" if skipped else ""))
        for note in notes:
            print(note)
        if first:
            size = f"max abs {first.max_abs:.3e} > {first.atol:g}" if first.max_abs == first.max_abs else ""
            if args.negative:  # a negative row fails when its wrong FFN is not caught or not named: its note says
                size = f"max abs {first.max_abs:.3e} against the tolerance {first.atol:g}"
            where = (f"checkpoint: {first.checkpoint} ({g.CHECKPOINTS.get(first.checkpoint, first.name)})"
                     + (f", layer {first.layer}" if first.layer is not None else "")
                     if first.checkpoint else "tensor: a weight as the engine loaded it")
            print(f"first failing {where}, {first.name}: {'; '.join(t for t in (size, first.note) if t)}")
        elif not judged:
            found = sorted(cand.names()) if cand else []
            if cand and cand.keys is None and not found:  # files, but none .npy or .bin
                other = sorted(p.name for p in cand.path.iterdir() if p.is_file() and p.suffix != ".safetensors")
                if other:
                    notes.append(f"{cand.path} holds {', '.join(other[:4])}{', ...' if len(other) > 4 else ''}: "
                                 "name each tensor NAME.npy or NAME.bin (raw little-endian float32)")
                    print(notes[-1])
            print("nothing was judged: no candidate tensor matches a golden name (they are named as "
                  "h0_ln_2, h0_ffn, logits, ...: see manifest.json)"
                  + (f"; found {', '.join(found[:8])}{', ...' if len(found) > 8 else ''}" if found else ""))
    if args.plot:
        from .plot import plot_verify
        plot_verify(rows, args.plot, f"{title} vs golden {Path(args.golden).name} ({gold.manifest['model']['source']})")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 1 if failed else 2 if not judged else 0  # nothing judged: it could not run, as a bad argument


def cmd_check(args):
    """Judge a learner's FFN, GELU or whole GPT-2 from a .py file, and say what is wrong."""
    import contextlib
    import json

    from .check import check, load_object
    try:
        with contextlib.redirect_stdout(sys.stderr):  # what the learner's file prints must not mix into the report
            obj, label = load_object(args.target)
            model = args.model or (f"random:{args.preset}:0" if args.preset else None)
            try:
                report = check(obj, golden=args.golden, layer=args.layer, config=args.config, name=label, model=model)
            except SystemExit as e:  # from the learner's __init__ or forward: it would end check with its own code
                raise Gpt2ffnError(f"{label} called sys.exit({e.code!r}) while check built or ran it") from None
    except Gpt2ffnError as e:
        if args.json:  # a JSON reader gets an object too (the one line on stderr and exit 2 stay)
            print(json.dumps({"kind": None, "subject": args.target, "target": args.target, "passed": False,
                              "error": str(e)}, indent=1))
        raise
    print(json.dumps(strict_json(report.as_dict()), indent=1) if args.json else report.format())
    return 0 if report.passed else 1


def cmd_gelu_effect(args):
    """What exact GELU does to GPT-2, at each FFN output and at the logits."""
    import json

    from .golden import gelu_effect
    from .tolerances import GOLDEN_ATOL
    r = gelu_effect(args.model, ids=args.ids, prompt=args.prompt)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"exact GELU vs GPT-2's tanh GELU on {r['model']}, {r['tokens']} tokens (tolerance {GOLDEN_ATOL:g})")
    print(f"{'layer':>5}  {'FFN out max |diff|':>19}")
    for row in r["ffn"]:
        verdict = "FAIL" if row["ffn_max_abs"] > GOLDEN_ATOL else "pass"
        print(f"{row['layer']:>5}  {row['ffn_max_abs']:>19.3e}  {verdict}")
    print(f"logits max |diff|: {r['logits_max_abs']:.3e}; argmax agrees on {100 * r['argmax_agree']:.1f}% of positions")
    return 0


def cmd_bench(args):
    """Side-by-side timings against the peers."""
    from .bench import run, summarize
    modes = [flag for flag, on in (("--kernels", args.kernels), ("--model", args.model), ("--accuracy", args.accuracy))
             if on]
    if len(modes) > 1:  # each is a run of its own ("instead:" in --help): one would have been dropped unsaid
        hint = "; the accuracy of a model is --accuracy --weights SPEC" if "--accuracy" in modes else ""
        raise UsageError(f"gpt2ffn bench: {' and '.join(modes)} are separate runs: give one{hint}")
    if isinstance(args.model, str):  # --model SPEC, as the other commands name the model
        if args.weights not in ("random:gpt2", args.model):
            raise UsageError(f"gpt2ffn bench: --model {args.model} and --weights {args.weights} name two models")
        args.model, args.weights = True, args.model
    ffn_dtype = args.device != "cpu" and set(args.precision or ()) <= {"fp32", "bf16"}  # the FFN grid's dtypes
    given = {"--batch": args.batch is not None and not args.model, "--precision": args.precision is not None and not
             (args.model or args.accuracy or ffn_dtype), "--weights": args.weights != "random:gpt2" and not
             (args.model or args.accuracy)}
    where = {"--batch": "--model", "--precision": "--model or --accuracy (or the FFN on --device cuda: fp32, bf16)",
             "--weights": "--model or --accuracy"}
    for flag, alone in given.items():  # a flag the FFN grid does not read would be ignored: say so before it runs
        if alone:
            raise UsageError(f"gpt2ffn bench: {flag} applies to {where[flag]}")
    result = run(args)
    if "forward" in result:
        print("\n" + summarize(result))
    return 0


def cmd_generate(args):
    """Stream a continuation of the prompt to the terminal and report tokens/s."""
    import time

    from .generate import Sampling, TextStream, engine_for, load, stream
    rank = _join(args.tp, args.command)
    if (args.prompt is None) == (args.ids is None):
        raise UsageError("gpt2ffn generate: give a prompt or --ids (token ids, e.g. --ids 15496,11,616)"
                         + (", not both" if args.prompt is not None else ""))
    if args.top_k is not None and args.top_k < -1:
        raise UsageError(f"gpt2ffn generate: --top-k must be >= 1, or 0 or -1 for off (HF's 0, vLLM's -1), "
                         f"got {args.top_k}")
    model, tok, name = load(args.model, _dtype(args.dtype), precision=args.precision, device=args.device, tp=args.tp,
                            activations=_activations(args.activations), kv_dtype=_dtype(args.kv_cache_dtype),
                            need_tokenizer=args.ids is None)
    if tok is None and args.stop:
        raise UsageError("gpt2ffn generate: --stop needs the checkpoint's tokenizer (tokenizer.json, or vocab.json + "
                         "merges.txt)")
    if any(not st for st in args.stop):
        raise UsageError("gpt2ffn generate: --stop takes non-empty strings (an empty one would stop at once)")
    decode = tok.decode if tok is not None else None
    ids = tok.encode(args.prompt) if args.ids is None else args.ids
    if args.ids is None and not ids:  # "": GPT-2's unconditional start, <|endoftext|>, as serve (and OpenAI) take it
        ids = model.config.eos_ids[:1] or [model.config.bos_token_id or 0]
    new = args.max_new_tokens
    if new is None:  # not given: 50, or what the context has room for (an 8-position model's 2-token prompt: 6)
        if len(ids) >= model.config.n_positions:
            raise UsageError(f"gpt2ffn generate: the prompt ({len(ids)} tokens) fills the context of "
                             f"{model.config.n_positions} positions: no room for a new token")
        new = min(50, model.config.n_positions - len(ids))
    s = Sampling(max_new_tokens=new, temperature=args.temperature, top_k=args.top_k or None,
                 top_p=args.top_p, seed=args.seed, eos_token_id=model.config.eos_token_id, stop=args.stop)
    if rank != 0:  # --tp: the other ranks run rank 0's forward passes on their shards
        engine_for(model, [ids], s, decode).follow()
        return _leave(args.tp)
    # with a tokenizer the text streams; without one (--ids) the new ids do, comma-separated as --ids takes them
    shown = args.prompt if args.ids is None else decode(ids) if decode else ",".join(map(str, ids))
    text, new, t0 = TextStream(decode, args.stop) if decode else None, [], time.perf_counter()
    steps = stream(model, [ids], s, decode)
    for step in steps:
        if not new:  # after the first step: a prompt the engine refuses is only named, not echoed
            print(shown, end="", flush=True)
        new.append(step[0])
        delta, stopped = text.push(step[0]) if text else (f",{step[0]}", False)
        print(delta, end="", flush=True)
        if stopped:
            break
    steps.close()  # --tp: releases the other ranks
    print(shown if not new else "", text.finish() if text else "", sep="")  # the answer ends its line on stdout
    dt = time.perf_counter() - t0
    tp = f", tensor-parallel over {args.tp} ranks" if args.tp > 1 else ""
    print(f"[{name}: {len(ids)} prompt + {len(new)} new tokens in {dt:.2f} s, {len(new) / dt:.1f} tokens/s{tp}]",
          file=sys.stderr)
    return _leave(args.tp)


def _join(tp: int, command: str) -> int:
    """--tp N > 1: join torchrun's process group (gpt2ffn.launch); this process's rank (0 without --tp)."""
    if tp < 1:
        raise UsageError(f"--tp must be >= 1, got {tp}")
    if tp == 1:
        return 0
    from .launch import init
    return init(tp, command)


def _leave(tp: int) -> int:
    if tp > 1:
        from .launch import finish
        finish()
    return 0


def _dtype(name):
    import torch
    return {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "float": torch.float32, "half": torch.float16}[name]  # the last two: vLLM's names


def cmd_serve(args):
    """OpenAI-compatible completions over HTTP."""
    try:
        from .serving.http import processes, serve
    except ImportError:
        raise Gpt2ffnError("serving needs fastapi and uvicorn: pip install 'gpt2ffn[serve]'") from None
    processes(args.engine_process, args.api_servers, args.tp)  # before torchrun is asked for: the flags conflict
    rank = _join(args.tp, args.command)
    key = os.environ.get("GPT2FFN_API_KEY")
    code = serve(args.model, args.host, args.port, args.max_batch, args.max_waiting, args.batch_invariant,
                 args.precision, args.chat_template, args.threads, args.device, _dtype(args.dtype),
                 args.kv_cache_fraction, args.tp, rank, api_keys=args.api_key or ([key] if key is not None else []),
                 metrics_public=args.metrics_public, ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
                 limit_concurrency=args.limit_concurrency, max_model_len=args.max_model_len, max_n=args.max_n,
                 activations=_activations(args.activations), kv_dtype=_dtype(args.kv_cache_dtype),
                 graph_seconds=args.cuda_graph_seconds, cuda_graphs=not args.no_cuda_graphs,
                 skip_tokenizer=args.skip_tokenizer_init, served_names=args.served_model_name or (),
                 shutdown_timeout=args.shutdown_timeout, stream_interval=args.stream_interval,
                 engine_process=args.engine_process, api_servers=args.api_servers)
    return code or _leave(args.tp)


def _activations(name):
    return None if name == "auto" else name


def _activations_arg(p):
    p.add_argument("--activations", choices=["auto", "fp32", "int8"], default="auto",
                   help="int8: integer dot products on activations quantized per group (int8/int4 weights); "
                   "auto: int8 for int8/int4 weights, fp32 for fp32/bf16 (README, \"Integer dot products\")")


def _kv_dtype_arg(p):
    p.add_argument("--kv-cache-dtype", choices=["auto", "float32", "float16"], default="auto",
                   help="the KV cache's dtype; auto: float16 for bf16/int8/int4 weights on the CPU (as llama.cpp's "
                   "f16 cache), else the weights' dtype (README, \"KV cache\")")


def _device_args(p):
    p.add_argument("--device", default="cpu", metavar="{auto,cpu,cuda[:N]}",
                   help="where the model runs: cpu (default), cuda[:N], or auto (CUDA when torch sees one)")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16", "float", "half"], default="auto",
                   help="dtype of every tensor (activations too); auto: bfloat16 on CUDA, float32 on the CPU "
                   "(needed for --precision); float and half as vLLM names float32 and float16")


def build_parser() -> Parser:
    from . import __version__
    parser = Parser(prog="gpt2ffn", description="The GPT-2 feed-forward network, proven against HuggingFace.")
    parser.add_argument("--version", action="version", version=f"gpt2ffn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("demo", help="run seed 000's FFN example and check it against the numpy reference")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("gelu", help="print GELU (tanh and exact) at points, or plot both with ReLU")
    p.add_argument("x", nargs="*", type=float, help="points to evaluate, e.g. -2 0.5 3 -1e-3")
    # argparse takes -1e-3 or -inf for an option (its negative numbers are -2 and -.5 only): any float is a point
    p._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-inf(inity)?$", re.I)
    p.add_argument("--plot", metavar="FILE", type=_plot_file,
                   help="write a PNG: tanh GELU, exact GELU, ReLU, and exact - tanh")
    p.set_defaults(func=cmd_gelu)
    p = sub.add_parser("extract", help="write golden tensors from HF GPT-2 (forward hooks) with a manifest")
    p.add_argument("--model", required=True, help="HF checkpoint directory, or random:<preset>[:seed] "
                   "(presets: gpt2, gpt2-medium, gpt2-large, gpt2-xl, tiny)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text, encoded with the tokenizer in the model directory")
    src.add_argument("--ids", type=_ids, help="token ids, e.g. 15496,11,616")
    p.add_argument("--out", required=True, type=_out_dir, help="output directory")
    p.add_argument("--layers", default="0", help="blocks to extract: comma-separated (0,3) or 'all' (default 0)")
    p.add_argument("--format", choices=("npy", "bin", "safetensors"), default="npy",
                   help="npy: a .npy file per tensor (default); bin: raw little-endian float32 per tensor, C order, "
                   "shapes in manifest.json (read with fread); safetensors: one golden.safetensors")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_extract)

    p = sub.add_parser("verify", help="judge gpt2ffn, or another engine's tensors, against golden tensors")
    p.add_argument("--golden", required=True, help="a directory written by gpt2ffn extract")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--candidate", help="another engine's tensors under the golden names: a directory of "
                      ".npy or raw float32 .bin files (h0_ffn.bin), or one .safetensors file")
    mode.add_argument("--negative", action="store_true", help="prove the judge fails known-wrong FFNs")
    p.add_argument("--atol", type=_atol, default=1e-4, help="absolute tolerance (default 1e-4, seed 001's)")
    p.add_argument("--tol", type=_tol, action="append", default=[], metavar="KEY=ATOL",
                   help="per-checkpoint tolerance by number (09), stage (ffn) or tensor (h0_ffn); repeatable")
    p.add_argument("--repeat", type=_at_least(1), default=1, help="also check that N runs are bit-identical")
    p.add_argument("--strict", action="store_true", help="a missing candidate file counts as a failure")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--plot", metavar="FILE", type=_plot_file, help="also write a PNG: max abs diff per checkpoint and "
                   "layer, tolerance as a line, failing bars marked")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("check", help="judge your own FFN, GELU or whole GPT-2 (FILE.py:NAME) and say what is wrong")
    p.add_argument("target", metavar="FILE.py:NAME", help="a class or an instance in the file (imported from its path)")
    p.add_argument("--golden", help="a directory written by gpt2ffn extract, or random:<preset>[:seed] "
                   "(default random:gpt2:0, computed offline)")
    p.add_argument("--layer", type=int, default=0, help="the block whose FFN weights and input to use (default 0)")
    p.add_argument("--config", help="what a class is built with: JSON (text or .json file) or a preset name; "
                   "default: the file's own config class with GPT-2's values, else the book-style dict of the "
                   "reference's width (GPT_CONFIG_124M for gpt2)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", help="the reference weights: an HF checkpoint directory or random:<preset>[:seed] "
                   "(a whole model's, or --layer's FFN; default: --golden's model, else random:gpt2:0)")
    g.add_argument("--preset", choices=["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "tiny"],
                   help="the same as --model random:<preset>:0 (gpt2-medium: seed 001's 1024-wide checkpoints)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("gelu-effect", help="measure how far exact GELU lands from GPT-2 (FFN outputs, logits)")
    p.add_argument("--model", required=True, help="HF checkpoint directory, or random:<preset>[:seed]")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text, encoded with the tokenizer in the model directory")
    src.add_argument("--ids", type=_ids, help="token ids, e.g. 15496,11,616")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_gelu_effect)

    p = sub.add_parser("generate", help="generate text with gpt2ffn's GPT-2 (KV cache), streamed")
    p.add_argument("prompt", nargs="?", help="text, encoded with the checkpoint's tokenizer")
    p.add_argument("--ids", type=_ids, help="the prompt as token ids instead, e.g. 15496,11,616: a checkpoint "
                   "without a tokenizer then streams the new ids")
    p.add_argument("--model", help="HF checkpoint directory or random:<preset>[:seed]; default: "
                   "openai-community/gpt2 from the local HF cache")
    p.add_argument("--max-new-tokens", type=int, help="default 50, or the room the context has left")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, help="sample from the k likeliest tokens; 0 or -1 = off (default)")
    p.add_argument("--top-p", type=float,
                   help="sample from the likeliest tokens whose probabilities sum to p (0 < p <= 1); default: off")
    p.add_argument("--seed", type=int, help="seed of the sampling: the same seed, the same tokens")
    p.add_argument("--stop", action="append", default=[], help="stop string; repeatable")
    _device_args(p)
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="weights of the linear layers: fp32 (default, exact), bf16, int8 or int4")
    _activations_arg(p)
    _kv_dtype_arg(p)
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (gpt2ffn.parallel); N > 1 runs under "
                   "torchrun --nproc-per-node N, fp32 weights (README, \"Tensor parallelism\")")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="serve OpenAI-compatible /v1/completions over HTTP")
    p.add_argument("--model", help="HF checkpoint directory or random:<preset>[:seed]; default: "
                   "openai-community/gpt2 from the local HF cache")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME", help="vLLM's: the names requests may give as "
                   "\"model\"; answers carry the first; default: the model's own name (a directory's name, "
                   "random:<preset>:<seed>)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--shutdown-timeout", type=float, default=60.0, metavar="SECONDS", help="at SIGTERM / Ctrl-C, "
                   "how long in-flight requests get to finish; then each ends with an error event saying why "
                   "(default 60; a second Ctrl-C: at once)")
    p.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=int, help="sequences decoded together "
                   "(default 64; vLLM's --max-num-seqs; the paged KV cache takes up to a quarter of free memory, at "
                   "most 2 GiB)")
    p.add_argument("--max-waiting", type=int, default=256, help="requests queued beyond the running batch; "
                   "more get 503 + Retry-After (default 256)")
    p.add_argument("--batch-invariant", action="store_true", help="each request's logits bitwise independent "
                   "of what runs beside it (slower: rows are computed one at a time)")
    p.add_argument("--precision", choices=["fp32", "bf16", "int8", "int4"], default="fp32",
                   help="weights' precision on the CPU (default fp32)")
    _activations_arg(p)
    _kv_dtype_arg(p)
    _device_args(p)
    p.add_argument("--kv-cache-fraction", type=float, metavar="F", help="the paged KV cache takes up to this "
                   "fraction of the memory free after loading (default: 0.25 of the host's, at most 2 GiB; "
                   "0.8 of the GPU's on CUDA)")
    p.add_argument("--cuda-graph-seconds", type=float, default=60.0, metavar="S", help="on CUDA, capture the "
                   "decode steps as CUDA graphs at start-up for up to S seconds, the rest on first use (default 60)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="on CUDA, run the decode steps eagerly")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template (as HF's apply_chat_template "
                   "uses): enables /v1/chat/completions")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (gpt2ffn.parallel); N > 1 runs under "
                   "torchrun --nproc-per-node N, fp32 weights (README, \"Tensor parallelism\")")
    p.add_argument("--api-key", action="append", metavar="KEY", help="require `Authorization: Bearer KEY` on "
                   "/v1/*, /tokenize, /detokenize and /metrics; repeatable (default: $GPT2FFN_API_KEY, else none)")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without a key")
    p.add_argument("--ssl-certfile", metavar="PEM", help="serve HTTPS with this certificate (chain)")
    p.add_argument("--ssl-keyfile", metavar="PEM", help="the certificate's private key")
    p.add_argument("--max-model-len", type=int, metavar="TOKENS", help="longest prompt + max_tokens a request "
                   "may ask for (default: the model's context); the KV cache is sized by it")
    p.add_argument("--max-n", type=int, default=16, help="largest n and best_of per request (default 16)")
    p.add_argument("--skip-tokenizer-init", action="store_true", help="vLLM's: read no tokenizer (a checkpoint "
                   "may have none): prompts are token ids, each choice carries token_ids and empty text, stops are "
                   "stop_token_ids")
    p.add_argument("--limit-concurrency", type=int, metavar="N", help="uvicorn's: beyond N connections or "
                   "requests at once, 503 at once (default: no limit; --max-waiting still applies; with "
                   "--api-servers, per API process)")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N", help="SGLang's: a streamed choice's "
                   "first token goes out at once, then a chunk every N tokens (and at its end): fewer events for "
                   "many streaming clients (default 1: every token)")
    p.add_argument("--engine-process", choices=("auto", "on", "off"), default="auto", help="the engine (model, "
                   "steps, sampling) in a process of its own, as vLLM's EngineCore, so HTTP and the steps do not share "
                   "one interpreter lock: on, off (a thread of the server's process), auto (default: on with CUDA)")
    p.add_argument("--api-servers", type=int, default=1, metavar="N", help="vLLM's --api-server-count: N processes "
                   "serve HTTP on the one port in front of the engine's own process (default 1)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="time gpt2ffn's FFN against HF, the book FFN, nn.GELU, torch.compile, numpy")
    p.add_argument("--quick", action="store_true", help="a small grid (d=768; tokens 1, 64, 512)")
    p.add_argument("--dims", type=_counts, help="n_embd values, e.g. 768,1600 (default 768,1024,1280,1600)")
    p.add_argument("--tokens", type=_counts, help="token counts, e.g. 1,64,2048 (default 1,8,64,512,2048)")
    p.add_argument("--repeats", type=_at_least(10), default=15, help="timed runs per point after warm-up (>= 10)")
    p.add_argument("--backward", action="store_true", help="also time forward+backward and saved activations")
    p.add_argument("--generate", action="store_true", help="also time HF generate with and without patch_hf")
    p.add_argument("--model", nargs="?", const=True, default=False, metavar="SPEC",
                   help="instead: the whole gpt2 (prefill, decode tokens/s) vs HF on seeded random weights: SPEC is "
                        "random:<preset>[:seed] (default: --weights); a checkpoint's accuracy: --accuracy "
                        "--weights DIR")
    p.add_argument("--batch", type=int, action="append", help="with --model --device cuda: a batch size to time "
                   "(repeatable; default 1, 32 and 256)")
    p.add_argument("--precision", choices=PRECISIONS, action="append",
                   help="with --model / --accuracy: the precisions (repeatable; default fp32 / all four)")
    p.add_argument("--kernels", action="store_true",
                   help="instead: GB/s of one-token GEMVs over 12 GPT-2 layers, per kernel and precision, vs DRAM")
    p.add_argument("--accuracy", action="store_true",
                   help="instead: KL divergence, top-1 and greedy agreement of each precision vs fp32")
    p.add_argument("--weights", default="random:gpt2",
                   help="with --accuracy: a checkpoint directory or random:<preset>[:seed] (default random:gpt2); "
                        "with --model: random:<preset>[:seed], the size timed (gpt2, gpt2-medium, -large, -xl)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu",
                   help="where the timed modules run (auto: CUDA when present; default cpu)")
    p.add_argument("--out", default="gpt2ffn-bench", type=_out_dir,
                   help="where the JSON and PNG go (default ./gpt2ffn-bench; the repository's committed results are "
                        "rewritten only by naming them: --out benchmarks/results)")
    p.set_defaults(func=cmd_bench)
    return parser


def _joined_ids(argv: list) -> list:
    """`--ids -1,2` as `--ids=-1,2`: argparse takes a value that starts with '-' (and is not one negative number)
    for an option, and would say only "expected one argument" where the range check names the bad id. Its
    abbreviations too (`--id`, `--i`: no other option starts with --i)."""
    out = []
    for arg in argv:
        if out and len(out[-1]) >= 3 and "--ids".startswith(out[-1]) and arg.startswith("-") and arg[1:2].isdigit():
            out[-1] = f"--ids={arg}"
        else:
            out.append(arg)
    return out


def main(argv=None) -> int:
    # HF's progress bars and config warnings ("Loading weights: 100%|...") are not the CLI's one-line output
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        args = build_parser().parse_args(_joined_ids(sys.argv[1:] if argv is None else list(argv)))
        with warnings.catch_warnings():  # gpt2ffn's warnings (loading.fit_vocab) in one line, as errors are
            warnings.showwarning = warning_line
            return args.func(args)
    except Gpt2ffnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `gpt2ffn verify --json | head`: the reader has gone; say nothing more (Python's recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:  # a file that cannot be read or written: what happened, to which file
        print(f"error: {e.filename}: {e.strerror}" if e.filename and e.strerror else f"error: {e}".splitlines()[0],
              file=sys.stderr)
        return 2
    except (ValueError, TypeError) as e:
        print(f"error: {e}".splitlines()[0], file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
