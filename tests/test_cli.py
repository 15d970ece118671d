import subprocess
import sys

import pytest

from gpt2ffn.cli import main


def test_demo_via_console_script():
    out = subprocess.run([sys.executable, "-m", "gpt2ffn.cli", "demo"], capture_output=True, text=True, check=True).stdout
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


@pytest.mark.parametrize("argv, message", [
    (["gelu"], "give one or more numbers"),
    (["nope"], "invalid choice: 'nope'"),
    (["gelu", "abc"], "invalid float value: 'abc'"),
    ([], "the following arguments are required: command"),
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
