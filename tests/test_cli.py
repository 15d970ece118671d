import dataclasses
import subprocess
import sys

import pytest

from gpt2ffn import Config
from gpt2ffn.cli import main


def test_demo_via_console_script():
    out = subprocess.run([sys.executable, "-m", "gpt2ffn.cli", "demo"], capture_output=True, text=True,
                         check=True).stdout
    assert "Input shape:  torch.Size([2, 3, 768])" in out
    assert "Output shape: torch.Size([2, 3, 768])" in out
    assert "✓ Shape preservation test passed!" in out
    assert "GELU outputs:     tensor([-0.0454, -0.1588,  0.0000,  0.8412,  1.9546])" in out
    diff = float(out.split("max |diff| = ")[1].split()[0])
    assert diff < 1e-5


def test_gelu_points(capsys):
    assert main(["gelu", "-2", "0.5", "3", "-2.7"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["x", "tanh", "(GPT-2)", "exact", "(erf)", "exact", "-", "tanh"]
    assert out[1].split() == ["-2.0000", "-0.0454023", "-0.0455003", "-9.796e-05"]
    assert out[4].split()[-1] == "-4.732e-04"


def test_gelu_plot(tmp_path, capsys):
    png = tmp_path / "gelu.png"
    assert main(["gelu", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["gelu", "--plot", str(tmp_path / "noext")]) == 0  # the file written is the file named
    assert capsys.readouterr().out.endswith(f"wrote {tmp_path / 'noext.png'}\n") and (tmp_path / "noext.png").is_file()


@pytest.mark.parametrize("argv, message", [
    (["gelu"], "give one or more numbers"),
    (["nope"], "invalid choice: 'nope'"),
    (["gelu", "abc"], "invalid float value: 'abc'"),
    ([], "the following arguments are required: command"),
    # from an outside round of the CLI: each was taken (or a Python class name) before
    (["gelu", "--plot", "/"], "argument --plot: / is a directory; give a file in it"),
    (["gelu", "--plot", ""], "argument --plot: give a file name"),
    (["gelu", "--plot", "x.txt"], "argument --plot: x.txt: write .png, .pdf, .svg, not .txt"),
    (["gelu", "--plot", "/nonexistent/x.png"], "error: /nonexistent/x.png: No such file or directory"),
    (["extract", "--model", "random:tiny", "--ids", "1", "--out", ""], "argument --out: give a directory"),
    (["extract", "--model", "random:tiny", "--ids", "1,,2", "--out", "o"], "argument --ids: expected comma-separated"),
    (["verify", "--golden", "g", "--repeat", "0"], "argument --repeat: an int >= 1, got '0'"),
    (["bench", "--repeats", "5"], "argument --repeats: an int >= 10, got '5'"),
    (["generate", "--model", "random:tiny", "--ids", "1,2", "--stop", ""], "--stop takes non-empty strings"),
    (["generate", "--model", "", "x"], "--model is empty"),
    (["generate", "--model", "random:tiny", "--ids", "1,2", "--top-k", "-2"],
     "--top-k must be >= 1, or 0 or -1 for off (HF's 0, vLLM's -1), got -2"),
    (["generate", "--model", "random:tiny", "--ids", "-1,2"], "token ids must be in [0, "),  # not argparse's
    (["generate", "--model", "random:tiny", "--id", "-1,2"], "token ids must be in [0, "),  # its abbreviation too
    (["serve", "--model", ""], "--model is empty"),
    (["bench", "--batch", "4"], "--batch applies to --model"),
    (["serve", "--model", "random:tiny", "--host", "a" * 70], "is not a host name"),
    (["bench", "--weights", "random:tiny"], "--weights applies to --model or --accuracy"),
    (["bench", "--kernels", "--accuracy"], "--kernels and --accuracy are separate runs: give one"),  # one was dropped
    (["bench", "--accuracy", "--model", "random:tiny"], "the accuracy of a model is --accuracy --weights SPEC"),
    (["bench", "--precision", "bf16"], "--precision applies to --model or --accuracy (or the FFN on --device cuda"),
    (["bench", "--precision", "bf16", "--device", "auto"], "the FFN bench on the CPU is fp32"),
])
def test_errors_are_one_line_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["gelu", "--help"], ["check", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0 and "usage: gpt2ffn" in capsys.readouterr().out


def test_generate_top_k_0_is_off_as_in_hf_and_the_server(capsys):
    argv = ["generate", "--model", "random:tiny", "--ids", "1,2", "--temperature", "0.8", "--seed", "3",
            "--max-new-tokens", "8"]
    assert main(argv) == 0
    whole = capsys.readouterr().out
    assert main([*argv, "--top-k", "0"]) == 0
    assert capsys.readouterr().out == whole
    assert main([*argv, "--top-k", "1"]) == 0  # negative control: top-k 1 is greedy, another draw
    assert capsys.readouterr().out != whole


def test_generate_precision(capsys):
    assert main(["generate", "--model", "random:tiny", "Hi", "--precision", "int8", "--max-new-tokens", "3"]) == 0
    assert main(["generate", "--model", "random:tiny", "Hi", "--dtype", "bfloat16", "--precision", "int4"]) == 2
    assert "error: precision='int4' quantizes a float32 model's weights" in capsys.readouterr().err


def test_kv_cache_dtype_flag(capsys):
    import torch

    from gpt2ffn.loading import load
    assert load("random:tiny", precision="int8")[0].kv_dtype == torch.float16  # auto
    assert load("random:tiny", precision="int8", kv_dtype=torch.float32)[0].kv_dtype == torch.float32
    assert load("random:tiny")[0].kv_dtype == torch.float32
    outs = {}
    for kv in ("auto", "float16", "float32"):
        assert main(["generate", "Hi", "--model", "random:tiny", "--precision", "int8", "--kv-cache-dtype", kv,
                     "--max-new-tokens", "4"]) == 0
        outs[kv] = capsys.readouterr().out
    assert outs["auto"] == outs["float16"] and outs["auto"].startswith("Hi")
    assert main(["generate", "Hi", "--model", "random:tiny", "--kv-cache-dtype", "int8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kv-cache-dtype" in err[0], err


def test_activations_flag(capsys):
    from gpt2ffn.loading import load
    model, _, _ = load("random:tiny", precision="int4", activations="int8")
    assert model.activations == "int8"
    assert load("random:tiny", precision="int4", activations="fp32")[0].activations == "fp32"
    assert main(["generate", "Hi", "--model", "random:tiny", "--precision", "int8", "--activations", "int8",
                 "--max-new-tokens", "2"]) == 0
    capsys.readouterr()
    assert main(["generate", "Hi", "--model", "random:tiny", "--activations", "int8"]) == 2   # fp32 weights
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "int8 activations need int8 or int4 weights, not fp32" in err[0], err
    assert main(["generate", "Hi", "--model", "random:tiny", "--dtype", "bfloat16", "--activations", "int8"]) == 2
    assert "applies to packed int8/int4 weights on the CPU" in capsys.readouterr().err


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    """A tiny random HF checkpoint with no tokenizer files (save_pretrained of the model alone)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("no_tokenizer")
    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=300, n_positions=64, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(d)
    return d


def test_a_checkpoint_without_a_tokenizer_generates_from_ids(no_tokenizer, tmp_path, capsys):
    """Text needs the tokenizer: a one-line error, named before any weight is read (a directory with only a
    config says tokenizer, not weights); --ids streams the new ids, the ones the Python API gives."""
    from gpt2ffn.generate import Sampling, generate, load
    assert main(["generate", "--model", str(no_tokenizer), "Hello"]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer in" in err and "--ids" in err and err.count("\n") == 1
    (tmp_path / "config.json").write_text((no_tokenizer / "config.json").read_text())
    assert main(["generate", "--model", str(tmp_path), "Hello"]) == 2
    assert "no tokenizer in" in capsys.readouterr().err
    assert main(["generate", "--model", str(no_tokenizer), "--ids", "1,2,3", "--max-new-tokens", "6"]) == 0
    out = capsys.readouterr().out
    model, tok, _ = load(str(no_tokenizer), need_tokenizer=False)
    assert tok is None
    assert out == ",".join(map(str, [1, 2, 3] + generate(model, [[1, 2, 3]], Sampling(max_new_tokens=6))[0])) + "\n"
    for argv, message in ((["Hello", "--ids", "1,2"], "give a prompt or --ids"), ([], "give a prompt or --ids"),
                          (["--ids", "1,2", "--stop", "x"], "--stop needs the checkpoint's tokenizer"),
                          (["--ids", "1,2,999"], "token ids must be in [0, 300)")):
        assert main(["generate", "--model", str(no_tokenizer), *argv]) == 2
        captured = capsys.readouterr()
        assert message in captured.err and captured.out == "", (argv, captured)
    (tmp_path / "model.safetensors").symlink_to(no_tokenizer / "model.safetensors")
    (tmp_path / "tokenizer.json").write_text("{not json")  # files that are there but broken: an error either way
    with pytest.raises(Exception, match="not a valid tokenizer file"):
        load(str(tmp_path), need_tokenizer=False)


@pytest.mark.parametrize("argv", [["--tokens", "-1"], ["--tokens", "0,8"], ["--dims", "x"], ["--dims", ""]])
def test_bench_sizes_must_be_positive(capsys, argv):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert "expected comma-separated positive ints" in err and err.count("\n") == 1


def test_bench_accuracy_skips_a_precision_the_widths_refuse(tmp_path):
    """n_embd 3 takes no int4 (two weights a byte): that row says why, the others are measured (and written); a
    context of one position has no new token to measure: one line."""
    import transformers

    from conftest import hf_config
    from gpt2ffn.bench import bench_accuracy
    cfg = Config(n_embd=3, n_head=1, n_layer=1, n_positions=8, vocab_size=50, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(hf_config(cfg)).save_pretrained(tmp_path / "w3")
    r = bench_accuracy(str(tmp_path / "w3"), ("int8", "int4"), log=lambda *a: None)
    assert r["precisions"]["int8"]["mean_kld"] >= 0 and r["precisions"]["int4"]["skipped"].startswith(
        "int4 needs a number of inputs per layer divisible by 2 (a byte holds two int4 weights); this layer has 3")
    transformers.GPT2LMHeadModel(hf_config(dataclasses.replace(cfg, n_positions=1))).save_pretrained(tmp_path / "p1")
    assert main(["bench", "--accuracy", "--weights", str(tmp_path / "p1"), "--out", str(tmp_path / "o")]) == 2


def test_bench_accuracy_fits_a_small_context():
    """One context window of the model's own (128 positions here), the prompt and greedy run cut to fit."""
    from gpt2ffn.bench import bench_accuracy
    r = bench_accuracy("random:tiny", ("int8",), log=lambda *a: None)
    assert r["positions"] == 128 and 0 <= r["precisions"]["int8"]["mean_kld"] < 1e-2


def test_bench_model_fits_a_small_context():
    """random:tiny has 128 positions: the 128-token prompt and 64 new tokens are cut to 64 + 64 (was an
    IndexError from HF's wpe inside generate, a traceback from the CLI)."""
    from gpt2ffn.bench import bench_model
    r = bench_model(weights="random:tiny", repeats=1, log=lambda *a: None)
    assert (r["prompt_tokens"], r["new_tokens"]) == (64, 64)
    assert r["engines"]["gpt2ffn fp32"]["greedy_same_as_hf"] == 1.0 and r["engines"]["gpt2ffn fp32"]["prefill_ms"] > 0


def test_generate_fits_its_default_length_to_a_small_context(tmp_path, capsys):
    """No --max-new-tokens on an 8-position model: the room the context has (it was 50, refused); given, checked."""
    from transformers import GPT2Config, GPT2LMHeadModel
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=8, vocab_size=64)).save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--ids", "1,2"]) == 0
    assert "2 prompt + 6 new tokens" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "--ids", "1,2", "--max-new-tokens", "7"]) == 2


def test_extract_into_an_old_set_removes_its_files(tmp_path, capsys):
    """A 1-block set over a 2-block one leaves no h1_* file behind (an engine reading by name took them)."""
    assert main(["extract", "--model", "random:tiny", "--ids", "1,2", "--layers", "all", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "h1_ffn.npy").is_file()
    (tmp_path / "mine.txt").write_text("a file of the user's: kept")
    assert main(["extract", "--model", "random:tiny", "--ids", "1,2", "--layers", "0", "--out", str(tmp_path)]) == 0
    assert not list(tmp_path.glob("h1_*")) and (tmp_path / "mine.txt").is_file()
    other = tmp_path / "other"  # a manifest.json that is not a golden set's: nothing it names is touched
    other.mkdir()
    (other / "manifest.json").write_text('{"tensors": {"x": {"file": "mine.txt"}}}')
    (other / "mine.txt").write_text("kept")
    assert main(["extract", "--model", "random:tiny", "--ids", "1,2", "--out", str(other)]) == 0
    assert (other / "mine.txt").read_text() == "kept"
    bundle = tmp_path / "bundle"  # a safetensors set, then an .npy one: the bundle goes
    for fmt in ("safetensors", "npy"):
        assert main(["extract", "--model", "random:tiny", "--ids", "1,2", "--format", fmt, "--out", str(bundle)]) == 0
    assert not list(bundle.glob("*.safetensors")) and (bundle / "h0_ffn.npy").is_file()


def test_an_untied_head_is_no_reference(tmp_path, capsys):
    """A checkpoint whose lm_head differs from wte: extract wrote logits from that head under a manifest saying
    ln_f @ wte^T, and check failed a correct model against it; both refuse it, as generate and verify do."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=16, vocab_size=64,
                               tie_word_embeddings=False)).save_pretrained(tmp_path / "m")
    assert main(["extract", "--model", str(tmp_path / "m"), "--ids", "1,2", "--out", str(tmp_path / "g")]) == 2
    assert "its lm_head.weight differs from wte" in capsys.readouterr().err


def test_gelu_takes_negative_numbers_in_any_notation(capsys):
    """argparse reads -1e-3 as an option unless told: every float is a point; a non-finite one is refused."""
    assert main(["gelu", "-1e-3", "-2.5E0", "-.5", "-3"]) == 0
    out = capsys.readouterr().out
    assert all(f" {x} " in out for x in ("-0.0010", "-2.5000", "-0.5000", "-3.0000")), out
    assert main(["gelu", "-inf"]) == 2
    err = capsys.readouterr().err
    assert err == "error: gpt2ffn gelu: give finite numbers, got -inf\n", err


def test_gelu_huge_points_fit_their_columns(capsys):
    """1e300 once printed 300 digits and numpy's overflow warning: an exponent, and no warning."""
    assert main(["gelu", "1e300", "-1e300", "2.7"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "", captured.err
    rows = [line.split() for line in captured.out.splitlines()[1:]]
    assert rows[0] == ["1.0000e+300", "1.0000000e+300", "1.0000000e+300", "0.000e+00"], rows
    assert rows[1][0] == "-1.0000e+300" and rows[2][:2] == ["2.7000", "2.6911124"], rows


def test_an_empty_prompt_starts_from_endoftext_as_serve_takes_it(capsys):
    """generate "": the text after <|endoftext|> (GPT-2's unconditional start), as serve answers an empty prompt."""
    from gpt2ffn.model import parse_random
    eos = parse_random("random:tiny")[0].eos_ids[0]
    assert main(["generate", "", "--model", "random:tiny", "--max-new-tokens", "4"]) == 0
    empty = capsys.readouterr().out
    assert main(["generate", "--ids", str(eos), "--model", "random:tiny", "--max-new-tokens", "4"]) == 0
    from_ids = capsys.readouterr().out  # the prompt's text echoed first
    assert len(empty) > 1 and from_ids.endswith(empty), (empty, from_ids)


def test_bos_and_eos_outside_the_vocabulary_fit_to_the_tokenizer(default_ids, tmp_path, capsys):
    """HF's GPT2Config keeps GPT-2's 50256 for any vocab_size: an empty prompt was refused as 'token ids must be in
    [0, 300); got min 50256' and EOS could never fire. Now the tokenizer's <|endoftext|> is used, with one warning
    line (also that the tokenizer is smaller than the model); without <|endoftext|>, BOS 0 and no EOS. A config
    whose ids fit is left as it is, unwarned (the control)."""
    import shutil
    import warnings

    from gpt2ffn.generate import load
    assert main(["generate", "--model", str(default_ids), "", "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: the checkpoint's bos_token_id 50256 and eos_token_id 50256 are outside "
                          "vocab_size 300") and "using BOS 0 and EOS 0 (the tokenizer's <|endoftext|>)" in err, err
    assert "the tokenizer has 280 tokens and the model 300: ids 280..299 decode to no text" in err
    model, _, _ = load(default_ids)
    assert (model.config.bos_token_id, model.config.eos_token_id) == (0, 0)
    plain = tmp_path / "plain"
    shutil.copytree(default_ids, plain, ignore=shutil.ignore_patterns("plain", "tokenizer.json"))
    shutil.copy(default_ids / "plain" / "tokenizer.json", plain)
    with pytest.warns(UserWarning, match="using BOS 0 and no EOS"):
        model, _, _ = load(plain)
    assert (model.config.bos_token_id, model.config.eos_token_id) == (0, None)
    (plain / "config.json").write_text((plain / "config.json").read_text().replace("50256", "7"))
    (plain / "generation_config.json").unlink(missing_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="the checkpoint's")
        model, _, _ = load(plain)
    assert (model.config.bos_token_id, model.config.eos_token_id) == (7, 7)


def test_generate_takes_sampling_fields_as_keywords(no_tokenizer):
    """generate(model, ids, max_new_tokens=...) as HF's generate is called (was a TypeError: missing `s`): the same
    tokens as with Sampling(..., eos_token_id=the config's); keywords replace an s's fields; an unknown one names
    the fields. Sampling is importable from the package."""
    from gpt2ffn import Gpt2ffnError, Sampling, generate
    from gpt2ffn.generate import load
    model, _, _ = load(no_tokenizer, need_tokenizer=False)
    want = generate(model, [[1, 2, 3]], Sampling(max_new_tokens=5, eos_token_id=model.config.eos_token_id))
    assert generate(model, [[1, 2, 3]], max_new_tokens=5) == want and len(want[0]) >= 1
    eos = generate(model, [[1, 2, 3]], Sampling(max_new_tokens=30))[0][5]  # the token at 6: EOS there ends it
    assert generate(model, [[1, 2, 3]], max_new_tokens=30, eos_token_id=eos)[0][-1] == eos  # stops at the EOS
    import dataclasses
    model.config = dataclasses.replace(model.config, eos_token_id=eos)  # the config's EOS is the default one
    assert generate(model, [[1, 2, 3]], max_new_tokens=30)[0][-1] == eos
    assert generate(model, [[1, 2, 3]], Sampling(max_new_tokens=1, ignore_eos=True), max_new_tokens=4)[0][:1] == \
        want[0][:1]
    assert len(generate(model, [[1, 2, 3]], Sampling(max_new_tokens=1, ignore_eos=True), max_new_tokens=4)[0]) == 4
    with pytest.raises(Gpt2ffnError, match="not max_tokens"):
        generate(model, [[1, 2]], max_tokens=3)
    for s in (None, Sampling()):  # a checkpoint's path for the model: named, with the way to load it (AttributeError)
        with pytest.raises(Gpt2ffnError, match="generate takes a loaded GPT-2, not a str .*generate.load\\(path\\)"):
            generate(str(no_tokenizer), [[1, 2]], s)


def test_bench_takes_model_spec_version_and_says_which_prompt_is_missing(tmp_path, capsys):
    """`bench --model random:tiny` as serve and generate name a model (was 'unrecognized arguments'), two models
    named is refused; `--version` answers; generate with neither a prompt nor --ids does not say 'not both'."""
    assert main(["bench", "--model", "random:tiny", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "bench-model-tiny.json").is_file()
    capsys.readouterr()
    assert main(["bench", "--model", "random:tiny", "--weights", "random:gpt2-xl", "--out", str(tmp_path)]) == 2
    assert "name two models" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("gpt2ffn ")
    assert main(["generate", "--model", "random:tiny"]) == 2
    err = capsys.readouterr().err
    assert "give a prompt or --ids" in err and "not both" not in err, err


def test_vllm_spellings_of_dtype_and_max_num_seqs(capsys):
    """vLLM's --dtype half / float and --max-num-seqs (for --max-batch) are taken (they were refused)."""
    from gpt2ffn.cli import build_parser
    assert build_parser().parse_args(["serve", "--max-num-seqs", "3"]).max_batch == 3
    for dtype in ("half", "float"):
        assert main(["generate", "--model", "random:tiny", "--ids", "1,2", "--dtype", dtype, "--max-new-tokens",
                     "1"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("flags, said", [(["--precision", "int8", "--dtype", "bfloat16"], "does not combine with"),
                                         (["--activations", "int8"], "int8 activations need int8 or int4 weights")])
def test_serve_refuses_flags_load_refuses_before_it_listens(flags, said, capsys):
    """Flags load() refuses together are one line and exit 2 before the port is bound (they were refused after
    'listening on ..., loading')."""
    assert main(["serve", "--model", "random:tiny", "--port", "0", *flags]) == 2
    out = capsys.readouterr()
    assert said in out.err and out.err.count("\n") == 1 and "listening" not in out.out + out.err, out


def test_fit_vocab_with_no_bos_and_a_partly_outside_eos_list(default_ids):
    """A config with bos_token_id null (it was a TypeError at load) and an EOS list of which one id is outside:
    the id in range is kept and said to be the config's own, not the tokenizer's."""
    import warnings

    from gpt2ffn.config import Config
    from gpt2ffn.loading import fit_vocab
    from gpt2ffn.tokenizer import load_tokenizer
    tok = load_tokenizer(default_ids)
    cfg = Config(n_embd=64, n_head=4, n_layer=1, vocab_size=300, bos_token_id=None, eos_token_id=[50256, 7])
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fitted = fit_vocab(cfg, tok)
    assert (fitted.bos_token_id, fitted.eos_token_id) == (None, 7)
    said = str(w[0].message)
    assert "eos_token_id 50256 is outside vocab_size 300" in said and "using EOS 7 (the rest of the config's)" in said
    assert "bos_token_id" not in said and "<|endoftext|>" not in said, said


def test_a_prompt_that_fills_the_context_is_named_as_such(capsys):
    """generate with no --max-new-tokens and a prompt as long as the context said 'prompt (N tokens) +
    max_new_tokens (1) exceeds the context', a 1 the user never gave; generate(model, []) said 'every prompt needs
    at least one token' of no prompt at all."""
    from gpt2ffn import Gpt2ffnError, generate
    from gpt2ffn.model import parse_random
    ctx = parse_random("random:tiny")[0].n_positions
    assert main(["generate", "--model", "random:tiny", "--ids", ",".join(["1"] * ctx)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: gpt2ffn generate: the prompt ({ctx} tokens) fills the context of {ctx} positions: no "
                   "room for a new token\n"), err
    from gpt2ffn.generate import load
    model, _, _ = load("random:tiny")
    with pytest.raises(Gpt2ffnError, match=r"generate was given no prompts: give a list of token-id lists"):
        generate(model, [], max_new_tokens=3)


def test_generate_top_k_minus_one_is_off_as_zero(capsys):
    """--top-k -1 (vLLM's off) was refused by the CLI though Sampling and the README take it (an outside tester)."""
    out = []
    for k in ("-1", "0"):
        assert main(["generate", "--model", "random:tiny", "--ids", "1,2", "--top-k", k, "--seed", "3",
                     "--temperature", "1", "--max-new-tokens", "6"]) == 0
        out.append(capsys.readouterr().out)
    assert out[0] == out[1] and out[0]
