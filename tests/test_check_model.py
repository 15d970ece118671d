"""gpt2ffn check on a whole GPT-2: nanoGPT's, the book's and HF's models pass as written, any config style
builds, each planted mistake is named at its first divergence, and an FFN with two mistakes gets both."""

import json
import re
import textwrap

import pytest
import torch

from gpt2ffn.check_model import reference
from gpt2ffn.cli import main
from gpt2ffn.diagnose import MISTAKES, MODEL_MISTAKES, block_forward
from gpt2ffn.tolerances import GOLDEN_ATOL
from learners import BOOK, HF, KARPATHY, MHA, MINGPT, MUTANTS, NANOGPT, OWN_PARAMS, plant

TINY = "random:tiny:3"  # n_embd 64, 2 blocks, 4 heads, vocab 512, 128 positions: the fast reference


def run(tmp_path, capsys, source, target, *args, name="learner.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    code = main(["check", f"{path}:{target}", "--model", TINY, *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("source, target, built, mapped", [
    (NANOGPT, "GPT", "built as GPT(GPTConfig(block_size=128, vocab_size=512, n_layer=2, n_head=4, n_embd=64, "
                     "dropout=0.1, bias=True))", "mapped by name (nanoGPT/HF naming); linear layers [out, in]"),
    (BOOK, "GPTModel", 'built as GPTModel(cfg), cfg = {"vocab_size": 512, "context_length": 128, "emb_dim": 64',
     "mapped by name (the book's naming); linear layers [out, in]; lm_head = out_head; out_head is not tied"),
    (HF, "model", "an instance of GPT2LMHeadModel", "mapped by name (nanoGPT/HF naming); linear layers [in, out]"),
    # lm_head not tied (minGPT's way): given wte's values, as nanoGPT's and minGPT's from_pretrained copy HF's
    # state_dict['lm_head.weight'] into it
    (NANOGPT.replace("        self.transformer.wte.weight = self.lm_head.weight  # https", "        # https"), "GPT",
     "built as GPT(GPTConfig(", "lm_head = lm_head; lm_head is not tied to transformer.wte: given wte's values"),
])
def test_learners_models_pass_as_written(source, target, built, mapped, tmp_path, capsys):
    code, out, err = run(tmp_path, capsys, source, target)
    lines = out.splitlines()
    assert code == 0, out + err
    assert lines[0].startswith("MODEL check of learner.py:") and lines[1].startswith("  " + built), lines[1]
    assert mapped in lines[2] and "random:tiny:3 (2 blocks, n_embd 64)" in lines[2]
    assert lines[-1].startswith(f"PASS: learner.py:{target} computes GPT-2 (2 blocks")
    assert lines[-2] == "seed 001's checkpoints: " + "  ".join(
        f"{ck:02d} {'--' if ck == 4 and source is HF else 'PASS'}" for ck in range(11))  # HF's softmax: no module
    for stage in ("00 embeddings", "03 k (KV cache)", "05 x + attention (1st residual)", "07 block output",
                  "09 logits", "10 greedy next 4 tokens"):
        assert any(line.startswith(stage) and line.split()[-1] == "PASS" or "PASS  got [" in line
                   for line in lines if line.startswith(stage)), stage


# The stage each planted mistake first shows at (the book's and nanoGPT's attention probabilities are hooked
# through their dropout modules).
FIRST = {"no_scale": "attn_probs", "no_mask": "attn_probs", "inverted_mask": "attn_probs",
         "softmax_axis": "attn_probs", "ln_unbiased": "ln_1", "ln_eps_1e-06": "ln_1", "post_norm": "ln_1",
         "no_resid_attn": "attn_resid", "no_resid_mlp": "block",
         "positions_not_added": "embeddings", "attn_c_proj_not_transposed": "attn_resid",
         "dropout": "attn_out", "qkv_bias_missing": "q", "gelu_exact": "gelu", "mask_off_by_one": "attn_probs",
         "heads_interleaved": "attn_probs", "q_k_swapped": "attn_probs", "ln_std_eps_biased": "ln_1",
         "positions_from_1": "embeddings", "logits_without_ln_f": "logits",
         "mask_zero_fill": "attn_probs", "ln_no_sqrt": "ln_1", "resid_normed": "attn_resid",
         "qkv_per_head": "attn_probs", "mask_excludes_self": "attn_probs", "gelu_after_c_proj": "gelu",
         "scale_d_head": "attn_probs", "softmax_heads": "attn_probs", "mask_after_softmax_inf": "attn_probs",
         "heads_reshaped": "attn_probs", "mask_keeps_future": "attn_out", "mask_float_01": "attn_out",
         "ln_2_for_attn": "q"}


@pytest.mark.parametrize("key", MUTANTS)
def test_each_planted_mistake_is_named_at_its_first_divergence(key, tmp_path, capsys):
    target = "GPT" if MUTANTS[key][0] is NANOGPT else "GPTModel"  # the book's and the MultiheadAttention one's
    code, out, err = run(tmp_path, capsys, plant(key), target, "--json")
    report = json.loads(out)
    assert code == 1 and not report["passed"], err
    assert report["diagnosis"]["key"] == key, report["verdict"]
    first = report["first_divergence"]
    assert first["stage"] == FIRST[key] and first["layer"] in (0, None), first
    assert report["verdict"].startswith("FAIL (first divergence: "), report["verdict"]
    if key in MISTAKES or key in MODEL_MISTAKES:
        assert {**MISTAKES, **MODEL_MISTAKES}[key][1] in report["verdict"]  # with what to change
    statuses = [r["status"] for r in report["rows"]]
    assert statuses.count("FAIL") == 1 and statuses[statuses.index("FAIL") + 1:].count("PASS") == 0


def test_report_stops_at_the_first_divergence(tmp_path, capsys):
    code, out, _ = run(tmp_path, capsys, plant("no_scale"), "GPT")
    rows = {line[:32].strip(): line for line in out.splitlines() if line[:2].isdigit()}
    assert code == 1
    assert rows["04 attention probabilities"].endswith("FAIL  (block 0)")
    assert rows["03 v (KV cache)"].split()[-1] == "PASS" and " 0  " in rows["03 v (KV cache)"]  # block 0 only
    assert rows["05 attention output (c_proj)"].endswith("--  not reached")
    assert out.splitlines()[-1].startswith("FAIL (first divergence: block 0, attention probabilities, checkpoint 04):"
                                           " attention scores not scaled by 1/sqrt(d_head) (within ")


def test_known_mistakes_are_computed_from_hf_and_differ_from_it():
    """The float64 block the mistakes are planted in equals HF's own stages; each mistake moves its stage by
    more than the tolerance (else naming it would be vacuous)."""
    ref = reference(TINY)
    t, cfg = ref.stages, ref.cfg
    for L in range(cfg.n_layer):
        w = {k: v.double() for k, v in ref.model.transformer.h[L].state_dict().items()}
        x = torch.from_numpy(t["embeddings"] if L == 0 else t[f"h{L - 1}_block"]).double()
        right = block_forward(x, w, cfg)
        for stage, value in right.items():
            if stage.endswith("_heads"):  # q, k, v split by head, (1, H, T, d/H): the golden sets' layout
                value = right[stage[0]].reshape(1, -1, cfg.n_head, cfg.n_embd // cfg.n_head).transpose(1, 2)
                assert torch.equal(right[stage], value)
                continue
            assert (value.numpy() - t[f"h{L}_{stage}"]).__abs__().max() < 1e-5, (L, stage)
        for key in MISTAKES:  # a LayerNorm's eps shows where the variance is small: block 0's embeddings
            if key in ("positions_not_added", "ln_eps_1e-05") or key.startswith("ln_") and L:
                continue
            stage = {"attn_c_proj_not_transposed": "attn_out", "c_attn_not_transposed": "q",
                     "qkv_bias_missing": "q"}.get(key, "ln_1" if key.startswith("ln_") else "block")
            wrong = block_forward(x, w, cfg, key)[stage]  # NaN (a row of -inf softmaxed) differs too
            assert (wrong - right[stage]).abs().nan_to_num(nan=1.0).max() > 2 * GOLDEN_ATOL, key


# ---- any config style ----------------------------------------------------------------------------------

NANOGPT_MLP = """
import torch.nn as nn
from dataclasses import dataclass


@dataclass
class GPTConfig:
    block_size: int = 1024
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


""" + NANOGPT[NANOGPT.index("class MLP("):NANOGPT.index("class Block(")]  # nanoGPT's MLP, as written


@pytest.mark.parametrize("source, built", [
    (NANOGPT_MLP, "built as MLP(GPTConfig(block_size=128, n_embd=64, dropout=0.1, bias=True))"),
    # No config class in the file: the book's dict is tried, then an object with both naming styles.
    (NANOGPT_MLP.replace("@dataclass\nclass GPTConfig:", "class Unused:").replace("n_embd: int = 768", "x = 1"),
     "built as MLP(config), an object with both naming styles (config.n_embd = config['emb_dim'] = 64), as "
     "its file has no config class"),
    # A plain class (not a dataclass) whose fields name the width d_model.
    (NANOGPT_MLP.replace("@dataclass\nclass GPTConfig:", "class ModelArgs:").replace("n_embd: int", "d_model: int")
     .replace("config.n_embd", "config.d_model"),
     "built as MLP(ModelArgs(block_size=128, d_model=64, dropout=0.1, bias=True))"),
])
def test_nanogpt_style_ffn_classes_build_and_pass(source, built, tmp_path, capsys):
    path = tmp_path / "mlp.py"
    path.write_text(source)
    code = main(["check", f"{path}:MLP", "--golden", TINY])
    out = capsys.readouterr().out
    assert code == 0 and out.splitlines()[1] == "  " + built, out
    assert out.splitlines()[-1].startswith("PASS: mlp.py:MLP computes GPT-2's FFN")


def test_config_overrides_a_config_class(tmp_path, capsys):
    path = tmp_path / "mlp.py"
    path.write_text(NANOGPT_MLP)
    code = main(["check", f"{path}:MLP", "--golden", TINY, "--config", '{"n_embd": 64, "bias": false}'])
    out = capsys.readouterr().out
    # the fields --config names, over the reference's (block_size 128: random:tiny's, not GPT-2's 1024)
    assert code == 1 and "built as MLP(GPTConfig(block_size=128, n_embd=64, dropout=0.1, bias=False))" in out
    assert out.splitlines()[-1].startswith("FAIL (after c_fc (1st linear)): both biases missing (c_fc and c_proj)")


def test_every_ffn_mistake_is_named_most_upstream_first(tmp_path, capsys):
    path = tmp_path / "mlp.py"
    path.write_text(NANOGPT_MLP.replace('nn.GELU(approximate="tanh")', "nn.ReLU()"))
    code = main(["check", f"{path}:MLP", "--golden", TINY, "--config", '{"n_embd": 64, "bias": false}', "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert [d["key"] for d in report["diagnoses"]] == ["c_fc_bias_missing", "gelu_relu", "c_proj_bias_missing"]
    assert [d["stage"] for d in report["diagnoses"]] == ["c_fc", "gelu", "ffn"]
    assert report["verdict"].startswith("FAIL: 3 known mistakes, most upstream first: (1) after c_fc (1st linear): "
                                        "c_fc bias missing (within ")
    assert "(2) after activation: ReLU instead of GELU" in report["verdict"]


# ---- mapping by shape and order, and what it refuses ------------------------------------------------------

OWN_NAMES = '''
import math
import torch
import torch.nn as nn
import torch.nn.functional as F


class Unit(nn.Module):  # a learner's own names: nothing to match by name
    def __init__(self, d, h):
        super().__init__()
        self.norm_a, self.norm_b = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mix = nn.Linear(d, 3 * d)
        self.back = nn.Linear(d, d)
        self.wide = nn.Linear(d, 4 * d)
        self.narrow = nn.Linear(4 * d, d)
        self.h = h

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.mix(self.norm_a(x)).split(C, -1)
        heads = lambda t: t.view(B, T, self.h, C // self.h).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.back(y.transpose(1, 2).reshape(B, T, C))
        return x + self.narrow(F.gelu(self.wide(self.norm_b(x)), approximate="tanh"))


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg["emb_dim"]
        self.tokens = nn.Embedding(cfg["vocab_size"], d)
        self.places = nn.Embedding(cfg["context_length"], d)
        self.stack = nn.ModuleList([Unit(d, cfg["n_heads"]) for _ in range(cfg["n_layers"])])
        self.last = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.tokens(idx) + self.places(torch.arange(idx.shape[1]))
        for unit in self.stack:
            x = unit(x)
        return self.last(x) @ self.tokens.weight.T
'''


def test_own_names_map_by_shape_and_order(tmp_path, capsys):
    code, out, err = run(tmp_path, capsys, OWN_NAMES, "Model")
    assert code == 0, out + err
    assert "mapped by shape and order within each block (names not HF's, nanoGPT's or the book's)" in out
    assert "04 attention probabilities" in out and "not hooked: no dropout module sees them" in out


@pytest.mark.parametrize("source, message", [
    (OWN_NAMES.replace("self.mix = nn.Linear(d, 3 * d)", "self.mix = nn.Linear(d, d)"),
     "stack.0 (Unit) has 0 layers of shape 64 x 192 and 2 of 64 x 64 (mix, back): cannot tell which is which"),
    (OWN_NAMES.replace('range(cfg["n_layers"])', "range(3)"),
     "Model has 3 blocks (stack); the reference has n_layer=2"),
    (OWN_NAMES.replace("self.norm_a, self.norm_b = nn.LayerNorm(d), nn.LayerNorm(d)", "self.norm_a = nn.LayerNorm(d)"),
     "stack.0 (Unit) has LayerNorms ['norm_a'] and other layers []"),
    (OWN_NAMES.replace("self.last = nn.LayerNorm(d)", "self.last = nn.LayerNorm(d)\n        self.extra = "
                       "nn.Parameter(torch.ones(1))"), "1 of 29 parameters have no GPT-2 tensor: extra"),
])
def test_what_cannot_be_mapped_is_refused_in_one_line(source, message, tmp_path, capsys):
    code, out, err = run(tmp_path, capsys, source, "Model")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert message in err, err


def test_preset_and_golden_name_the_reference(tmp_path, capsys):
    golden = tmp_path / "g"
    assert main(["extract", "--model", TINY, "--ids", "1,2,3", "--out", str(golden), "--quiet"]) == 0
    path = tmp_path / "nano.py"
    path.write_text(NANOGPT)
    assert main(["check", f"{path}:GPT", "--golden", str(golden)]) == 0
    assert "weights: random:tiny:3 (2 blocks" in capsys.readouterr().out
    assert main(["check", f"{path}:GPT", "--preset", "tiny"]) == 0
    assert "weights: random:tiny:0 (2 blocks" in capsys.readouterr().out


# ---- the way other public code writes it ---------------------------------------------------------------

def test_mingpt_as_its_repository_lays_it_out(tmp_path, monkeypatch, capsys):
    """minGPT's mingpt/model.py, checked from the repository's root as its users run it: the package imports
    (`from mingpt.utils import CfgNode`), GPT is built from its own GPT.get_default_config(), its untied lm_head
    is given wte's values (as its from_pretrained copies HF's lm_head.weight), and the FFN output is seen though
    its MLP is a ModuleDict run by a lambda."""
    for name, text in MINGPT.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    code = main(["check", "mingpt/model.py:GPT", "--model", TINY])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0, "\n".join(lines)
    assert lines[1] == ("  built as GPT(GPT.get_default_config() with n_layer=2, n_head=4, n_embd=64, vocab_size=512, "
                        "block_size=128, embd_pdrop=0.1, resid_pdrop=0.1, attn_pdrop=0.1, model_type=None)")
    assert "lm_head = lm_head; lm_head is not tied to transformer.wte: given wte's values" in lines[2]
    ffn = next(line for line in lines if line.startswith("06 FFN output"))
    assert ffn.split()[-1] == "PASS" and " 0-1 " in ffn
    assert main(["check", "mingpt/model.py:NewGELU"]) == 0
    capsys.readouterr()


def test_a_file_imports_its_neighbours(tmp_path, capsys):
    """The book's later chapters start `from previous_chapters import ...`: the file's folder is on the path,
    as `python FILE.py` puts it, wherever check is run from."""
    (tmp_path / "previous_chapters.py").write_text(textwrap.dedent(BOOK))
    (tmp_path / "chapter05.py").write_text("from previous_chapters import GPTModel, FeedForward  # noqa: F401\n")
    code = main(["check", f"{tmp_path / 'chapter05.py'}:GPTModel", "--model", TINY])
    out = capsys.readouterr().out
    assert code == 0 and out.splitlines()[-1].startswith("PASS: chapter05.py:GPTModel computes GPT-2"), out


@pytest.mark.parametrize("old, new, says", [
    # the book's FeedForward returning x + FFN(x): judged at the FFN's own output (ff, not ff.layers)
    ("        return self.layers(x)", "        return x + self.layers(x)",
     "FAIL (first divergence: block 0, FFN output, checkpoint 06): residual added inside the FFN"),
    # ln_2 alone with another eps: named on HF's own input to ln_2
    ('        self.norm2 = LayerNorm(cfg["emb_dim"])', '        self.norm2 = LayerNorm(cfg["emb_dim"])\n'
     "        self.norm2.eps = 1e-3", "FAIL (first divergence: block 0, ln_2, checkpoint 05): LayerNorm eps 0.001"),
])
def test_mistakes_inside_one_module_are_named_where_they_are(old, new, says, tmp_path, capsys):
    assert BOOK.count(old) == 1
    code, out, _ = run(tmp_path, capsys, BOOK.replace(old, new), "GPTModel")
    assert code == 1 and out.splitlines()[-1].startswith(says), out.splitlines()[-1]


PARTS = NANOGPT + """
cfg = GPTConfig(block_size=128, vocab_size=512, n_layer=2, n_head=4, n_embd=64)
padded = GPT(GPTConfig(block_size=128, vocab_size=576, n_layer=2, n_head=4, n_embd=64))
short = GPT(GPTConfig(block_size=32, vocab_size=512, n_layer=2, n_head=4, n_embd=64))
ln = nn.LayerNorm(64)
linear = nn.Linear(64, 256)
attn = CausalSelfAttention(cfg)
block = Block(cfg)
dict_mlp = nn.ModuleDict(dict(c_fc=nn.Linear(64, 256), c_proj=nn.Linear(256, 64)))


class BookLayerNorm(nn.Module):  # the book's LayerNorm(emb_dim)
    def __init__(self, emb_dim):
        super().__init__()
        self.scale, self.shift = nn.Parameter(torch.ones(emb_dim)), nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x):
        return self.scale * (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True) + 1e-5) + self.shift


class FeedFoward(nn.Module):  # Karpathy's lecture (ng-video-lecture's gpt.py), ReLU and all
    def __init__(self, n_embd):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.ReLU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(0.2))

    def forward(self, x):
        return self.net(x)


import transformers  # noqa: E402
trunk = transformers.GPT2Model(transformers.GPT2Config(n_positions=128, vocab_size=512, n_layer=2, n_head=4, n_embd=64))
"""


@pytest.mark.parametrize("target, code, says", [
    ("short", 0, "transformer.wpe holds 32 positions: given GPT-2's first 32 (of 128)"),
    ("padded", 2, "(transformer.wte pads the vocabulary to 576, as nanoGPT's GPTConfig() default does): build it "
                  "with vocab_size=512, as nanoGPT's from_pretrained does"),
    ("ln", 2, "holds parameters but no linear layer: a LayerNorm? check judges GPT-2's FFN, its GELU or the whole "
              "model"),
    ("linear", 2, "is one linear layer ((256, 64)); check judges"),
    ("attn", 2, "has a layer of shape 64 x 192 (c_attn: q, k and v): it is attention, not an FFN"),
    ("block", 2, "an FFN has two, c_fc then c_proj: attention or a whole block? check judges"),
    ("dict_mlp", 2, "is an nn.ModuleDict, which has no forward of its own: check the module that runs it"),
    ("BookLayerNorm", 2, "BookLayerNorm holds parameters but no linear layer: a LayerNorm?"),
    ("FeedFoward", 1, "built as FeedFoward(n_embd=64)"),
    ("trunk", 0, "no LM head: its output (1, 6, 64) taken as the last hidden state, logits by GPT-2's tied head"),
])
def test_parts_and_variants_of_a_model(target, code, says, tmp_path, capsys):
    """A shorter context runs on wpe's first positions; a padded vocabulary and a part that is not an FFN, a GELU
    or a whole model are refused in one line that says what to check instead."""
    got, out, err = run(tmp_path, capsys, PARTS, target, "--golden", TINY)
    assert got == code and says in (out if code < 2 else err), out + err
    assert code < 2 or err.count("\n") == 1
    assert code != 1 or "FAIL (after activation): ReLU instead of GELU" in out


def test_a_reference_with_a_short_context(tmp_path, capsys):
    """A reference checkpoint of fewer positions than the prompt + greedy tokens (6 + 4): a shorter prompt, then
    fewer new tokens (was an IndexError from HF's wpe)."""
    import transformers
    for n, new in ((7, 4), (2, 1)):
        cfg = transformers.GPT2Config(n_embd=40, n_head=5, n_layer=1, n_positions=n, vocab_size=257)
        transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / f"p{n}")
        code, out, err = run(tmp_path, capsys, f"""
            import transformers
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=40, n_head=5, n_layer=1,
                                                                       n_positions={n}, vocab_size=257))
            """, "model", "--model", str(tmp_path / f"p{n}"))
        assert code == 0 and f"greedy next {new} token{'s' * (new > 1)}" in out, out + err


def test_a_head_its_forward_never_applies_is_said(tmp_path, capsys):
    """A model holding lm_head that returns the hidden state is refused in one line (it was taken for HF's
    GPT2Model, given GPT-2's tied head, and passed); HF's GPT2Model itself, with no head, still passes."""
    source = NANOGPT.replace("logits = self.lm_head(x[:, [-1], :])", "logits = x[:, [-1], :]")
    assert source != NANOGPT
    code, out, err = run(tmp_path, capsys, source, "GPT")
    assert code == 2 and err.count("\n") == 1, out + err
    assert "the hidden state, not logits (1, T, 512): it holds an LM head, lm_head, that its forward never" in err


@pytest.fixture(scope="module")
def loud_dir(tmp_path_factory):
    """random:tiny:3 with wpe x 1000: a residual stream of ~1000s, as real GPT-2's outlier features (to ~3000),
    where one fp32 ulp is 6e-5 and a correct fp32 engine's own rounding passes 1e-4."""
    from gpt2ffn.golden import load_reference
    model = load_reference(TINY)[0]
    with torch.no_grad():
        model.transformer.wpe.weight.mul_(1000)
    path = tmp_path_factory.mktemp("loud")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("rel, passes", [(0.0, True), (2e-6, True), (1e-4, False)])
def test_the_residual_stream_is_judged_relative_to_its_size(rel, passes, loud_dir, tmp_path, capsys):
    """The block output is judged at max(1e-4, 1e-5 x max|value|), as `verify` judges it: 2e-6 of a ~1000-sized
    stream (2e-3 absolute, what fp32 rounding in another order gives there) passes; 1e-4 of it fails (the
    negative control: the scaled bar still fails a real error)."""
    old = "        x = x + self.mlp(self.ln_2(x))\n"
    source = NANOGPT.replace(old, old + f"        x = x + {rel} * x.abs().amax()\n")
    path = tmp_path / "learner.py"
    path.write_text(textwrap.dedent(source))
    code = main(["check", f"{path}:GPT", "--model", str(loud_dir), "--json"])
    report = json.loads(capsys.readouterr().out)
    block = next(r for r in report["rows"] if r["checkpoint"] == "07")
    assert (code == 0) == passes, report["verdict"]
    assert block["status"] == ("PASS" if passes else "FAIL") and block["atol"] > 1e-3, block
    if rel:
        assert block["max_abs"] > GOLDEN_ATOL  # above the absolute bar: it passed before only if scaled


@pytest.mark.parametrize("old, new, verdict", [
    (None, None, "; block 0's FFN also passes alone on its input scaled"),
    ('nn.GELU(approximate="tanh")', "nn.GELU()", "exact GELU (erf) where the config says tanh GELU"),
    ("self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)",
     "self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)", "c_proj bias missing"),
])
def test_a_model_pass_on_small_ffn_inputs_probes_its_ffn_alone(old, new, verdict, quiet_dir, tmp_path, capsys):
    """On a checkpoint saved from HF's random init every stage of a model with the exact GELU passes within
    1e-4 (the prompt's FFN inputs are too small to tell); its FFN module is then judged alone on its input
    scaled, as check judges an FFN, and the mistake fails the model at checkpoint 06. The right model still
    passes; the unprobed stages pass in each case (the control: only the probe can tell)."""
    source = NANOGPT if old is None else NANOGPT.replace(old, new)
    assert old is None or source != NANOGPT
    path = tmp_path / "learner.py"
    path.write_text(textwrap.dedent(source))
    code = main(["check", f"{path}:GPT", "--model", str(quiet_dir), "--json"])
    report = json.loads(capsys.readouterr().out)
    alone = [r for r in report["rows"] if r["stage"].startswith("FFN alone")]
    assert all(r["status"] == "PASS" for r in report["rows"] if r not in alone), report["rows"]
    assert len(alone) == 1 and alone[0]["checkpoint"] == "06", report["rows"]
    assert (code == 0) == (old is None) and verdict in report["verdict"], report["verdict"]
    if old is not None:
        assert report["first_divergence"]["checkpoint"] == "06" and alone[0]["status"] == "FAIL"


def test_a_model_on_telling_inputs_is_not_probed(tmp_path, capsys):
    """random:tiny's FFN inputs already tell the known FFN mistakes apart: no extra row, the plain verdict."""
    code, out, err = run(tmp_path, capsys, NANOGPT, "GPT")
    assert code == 0 and "FFN alone" not in out and "judged alone too" not in out, out + err


NOTEBOOK_FFN = '''
# coding: utf-8
get_ipython().run_line_magic('matplotlib', 'inline')
get_ipython().system('pip install torch')
import torch
import torch.nn as nn

class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.W1, self.b1 = nn.Parameter(torch.zeros(64, 256)), nn.Parameter(torch.zeros(256))
        self.W2, self.b2 = nn.Parameter(torch.zeros(256, 64)), nn.Parameter(torch.zeros(64))
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.act(x @ self.W1 + self.b1) @ self.W2 + self.b2
'''


W1B1 = """        d = config.n_embd
        self.W1, self.b1 = nn.Parameter(torch.zeros(d, 4 * d)), nn.Parameter(torch.zeros(4 * d))
        self.W2, self.b2 = nn.Parameter(torch.zeros(4 * d, d)), nn.Parameter(torch.zeros(d))
        self.gelu = nn.GELU(approximate="tanh")

    def forward(self, x):
        return self.gelu(x @ self.W1 + self.b1) @ self.W2 + self.b2
"""


@pytest.mark.parametrize("source, target, said", [
    (MHA, "GPTModel", "PASS: learner.py:GPTModel computes GPT-2"),                       # nn.MultiheadAttention
    (MHA.replace("attn_mask=self.mask[:T, :T], ", ""), "GPTModel", "no causal mask"),   # ... and a mistake in it
    (OWN_PARAMS, "GPT", "PASS"),                                                          # attention's own Parameters
    # a square c_proj_w read as [out, in] beside c_attn_w's [in, out]: GPT-2 in that layout (its shape cannot tell;
    # test_a_square_layer_of_its_own_in_the_other_layout)
    (OWN_PARAMS.replace("y @ self.c_proj_w", "y @ self.c_proj_w.T"), "GPT", "PASS"),
    (NANOGPT.replace("return logits, loss", "return {'logits': logits, 'loss': loss}"), "GPT", "PASS"),  # a dict
    (NANOGPT + "\nmodel = GPT(GPTConfig(block_size=128, vocab_size=512, n_layer=2, n_head=4, n_embd=64))"
               ".to(torch.bfloat16)\n", "model", "PASS"),                                 # kept in bf16
    (NANOGPT.replace("    def __init__(self, config):\n        super().__init__()\n        self.config = config\n",
                     "    def __init__(self, *, vocab_size, block_size, n_layer, n_head, n_embd, dropout=0.0, "
                     "bias=True):\n        super().__init__()\n        self.config = config = GPTConfig("
                     "block_size, vocab_size, n_layer, n_head, n_embd, dropout, bias)\n"),
     "GPT", "PASS"),                                                       # required keyword arguments, GPT-2's names
    (re.sub(r"(class MLP\(nn.Module\):\n\n    def __init__\(self, config\):\n        super\(\).__init__\(\)\n)"
            r"(.|\n)*?(\n\nclass Block)", lambda m: m[1] + W1B1 + m[3], NANOGPT), "GPT", "PASS"),  # W1, b1 Parameters
    (re.sub(r"config\.(\w+)", r'config["\1"]', re.sub(r"@dataclass\nclass GPTConfig:\n(    .*\n)+", "", NANOGPT)),
     "GPT", "PASS"),                                                                       # cfg["n_embd"], a dict
])
def test_more_ways_learners_write_it(source, target, said, tmp_path, capsys):
    """From an outside round of learners' code: each was refused or failed unexplained before."""
    code, out, err = run(tmp_path, capsys, source, target)
    assert said in out.splitlines()[-1], out + err


def test_a_notebook_export_and_an_ffn_of_parameters_with_an_activation_module(tmp_path, capsys):
    """nbconvert's get_ipython() lines do nothing (the import failed on them); an FFN holding W1, b1, W2, b2 and
    an nn.GELU child is an FFN of its own Parameters (it was refused: 'no linear layer')."""
    code, out, err = run(tmp_path, capsys, NOTEBOOK_FFN, "FeedForward", name="nb.py")
    assert code == 0 and "PASS: nb.py:FeedForward computes GPT-2's FFN" in out, out + err


def test_a_model_instance_comes_back_as_it_came():
    """check(model) loads the reference's weights into a learner's whole model to judge it, then puts the
    model's own back (its tied embedding and head still one tensor). Control: it was judged on other weights."""
    import transformers

    from gpt2ffn import check
    torch.manual_seed(1)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=128, vocab_size=512, n_layer=2,
                                                                 n_head=4, n_embd=64)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []
    model.transformer.wte.register_forward_hook(lambda m, a, out: seen.append(m.weight.detach().clone()))
    report = check(model, model=TINY)
    assert report.passed, report.format()
    assert any(not torch.equal(w, before["transformer.wte.weight"]) for w in seen)
    assert model.training and model.lm_head.weight is model.transformer.wte.weight
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_an_ffn_of_another_width_than_the_checkpoints_is_named(tmp_path, capsys):
    """The book's GPTModel builds its FFN 4 x n_embd wide; a checkpoint with n_inner = 100 gets one line naming
    the widths (it was 'has LayerNorms [...] and other layers [...]', the cause unsaid). Control: the same model
    against a checkpoint of 4 x n_embd passes."""
    import transformers
    for inner in (100, None):
        cfg = transformers.GPT2Config(n_embd=64, n_head=4, n_layer=1, n_positions=32, vocab_size=300, n_inner=inner)
        transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / f"w{inner}")
    path = tmp_path / "book.py"
    path.write_text(textwrap.dedent(BOOK))
    capsys.readouterr()  # HF's progress bars
    assert main(["check", f"{path}:GPTModel", "--model", str(tmp_path / "w100")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("FFN (ff.layers.0, ff.layers.2) is 256 wide (4x n_embd); the reference's is "
                                     "n_inner = 100 (1.562x): no weights of it fit") in err, err
    assert main(["check", f"{path}:GPTModel", "--model", str(tmp_path / "wNone")]) == 0


@pytest.mark.parametrize("act, passes", [('nn.GELU(approximate="tanh")', True), ("nn.GELU()", False)])
def test_an_ffn_of_own_parameters_is_probed_through_its_output(act, passes, quiet_dir, tmp_path, capsys):
    """An FFN computing x @ W1 + b1 itself (no linear layer to hook, its activation unseen): the probe's c_proj
    passes the hidden units through, so the exact GELU shows in the output (with c_proj's own weights it passed
    the scaled check too)."""
    source = re.sub(r"(class MLP\(nn.Module\):\n\n    def __init__\(self, config\):\n        super\(\).__init__\(\)\n)"
                    r"(.|\n)*?(\n\nclass Block)", lambda m: m[1] + W1B1.replace('nn.GELU(approximate="tanh")', act)
                    + m[3], NANOGPT)
    assert source != NANOGPT
    path = tmp_path / "learner.py"
    path.write_text(textwrap.dedent(source))
    code = main(["check", f"{path}:GPT", "--model", str(quiet_dir), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert (code == 0) == passes and any(r["stage"].startswith("FFN alone") for r in report["rows"])
    assert passes or "exact GELU (erf)" in report["verdict"], report["verdict"]


def test_an_ffn_module_that_is_not_gpt2s_ffn_alone_is_said_unprobed(quiet_dir, tmp_path, capsys):
    """ln_2 moved inside the MLP module (its forward normalizes first): the model passes on the quiet checkpoint,
    but the module alone on ln_2's output is not GPT-2's FFN, so the probe cannot run: the report says the prompt
    could not tell the FFN's mistakes, where it had said nothing."""
    source = NANOGPT.replace("        x = x + self.mlp(self.ln_2(x))", "        x = x + self.mlp(x)")
    source = source.replace("    def forward(self, x):\n        x = self.c_fc(x)",
                            "    def forward(self, x):\n        x = self.c_fc(self.ln_2(x))")
    source = source.replace("        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)\n", "")  # the block's
    source = source.replace("        self.c_fc = nn.Linear(", "        self.ln_2 = LayerNorm(config.n_embd, "
                                                               "bias=config.bias)\n        self.c_fc = nn.Linear(", 1)
    assert source.count("self.ln_2(") == 1 and source.count("self.ln_2 = ") == 1, "ln_2 moved into MLP"
    path = tmp_path / "learner.py"
    path.write_text(textwrap.dedent(source))
    code = main(["check", f"{path}:GPT", "--model", str(quiet_dir)])
    out = capsys.readouterr().out
    assert code == 0 and "known FFN mistakes also pass within 1e-04" in out and "check the FFN by itself" in out, out


def forced_report(source, every, tmp_path, capsys, passes):
    if every:
        source = source.replace("logits = self.lm_head(x[:, [-1], :])", "logits = self.lm_head(x)")
    code, out, err = run(tmp_path, capsys, source, "GPT", "--json")
    report = json.loads(out)
    forced = next(r for r in report["rows"] if r["stage"] == "logits on prompt + 4 (forced)")
    assert forced["shape"][1] == (10 if every else 1) and forced["status"] == ("PASS" if passes else "FAIL"), forced
    assert code == (0 if passes else 1), report["verdict"]
    return report


@pytest.mark.parametrize("old, new, passes", [
    ("self.bias[:, :, :T, :T] == 0", "self.bias[:, :, :T, :T] == 0", True),  # the control: nanoGPT as written
    # rows from 6 on (past the 6-token prompt) see later positions: every stage on the prompt passes, and so did
    # the greedy tokens on this reference
    ("att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))",
     "mask = self.bias[:, :, :T, :T] == 0\n        mask[..., 6:, :] = False\n"
     "        att = att.masked_fill(mask, float('-inf'))", False),
])
def test_logits_past_the_prompt_are_judged_teacher_forced(old, new, passes, tmp_path, capsys):
    """A mask that goes wrong only past the prompt's length passed: the stages see the 6-token prompt, and the
    greedy steps compared argmaxes. The logits over the prompt and HF's greedy tokens, one forward, are judged at
    the logits' tolerance (checkpoint 10), every position the model returns."""
    source = NANOGPT.replace(old, new)
    assert source != NANOGPT or passes
    for every in (False, True):  # nanoGPT as written returns the last position's logits; then every position's
        report = forced_report(source, every, tmp_path, capsys, passes)
    forced = next(r for r in report["rows"] if r["stage"] == "logits on prompt + 4 (forced)")
    assert forced["checkpoint"] == "10" and forced["shape"][1] == 10, forced
    if passes:
        assert report["passed"], report["verdict"]
        return
    assert not report["passed"], report["verdict"]
    assert report["verdict"].startswith("FAIL (logits past the prompt, checkpoint 10): position "), report["verdict"]
    assert int(report["verdict"].split("position ")[1].split()[0]) >= 6, report["verdict"]
    assert "a causal mask or position that goes wrong only past the prompt's length?" in report["verdict"]
    assert report["first_divergence"]["stage"] == "logits_forced"
    assert all(r["status"] != "FAIL" for r in report["rows"]
               if r is not forced and r["stage"] != "logits, a batch of 2 (forced)")  # the same positions there


@pytest.mark.parametrize("merge", [
    "y.permute(2, 0, 1, 3).reshape(B, T, C)",  # heads merged across the batch axis: right for one sequence alone
    "y.transpose(1, 2).reshape(1, B * T, C).reshape(B, T, C)",  # the control: right for any batch
])
def test_a_batch_of_two_sequences_is_judged(merge, tmp_path, capsys):
    """The stages and the forced logits see one sequence; a head merge that permutes the batch axis (or attention
    or a LayerNorm over it) is right for one and wrong for a batch, and passed. Checkpoint 10 also judges the
    logits of a batch of 2 sequences against HF's on the same batch."""
    old = "y = y.transpose(1, 2).contiguous().view(B, T, C)"
    source = NANOGPT.replace("logits = self.lm_head(x[:, [-1], :])", "logits = self.lm_head(x)")
    assert old in source
    code, out, _ = run(tmp_path, capsys, source.replace(old, f"y = {merge}"), "GPT", "--json")
    report = json.loads(out)
    batch = next(r for r in report["rows"] if r["stage"] == "logits, a batch of 2 (forced)")
    if "permute" not in merge:
        assert code == 0 and batch["status"] == "PASS" and batch["shape"] == [2, 10, 512], batch
        return
    assert code == 1 and batch["status"] == "FAIL" and report["first_divergence"]["stage"] == "logits_batch", report
    assert report["verdict"].startswith("FAIL (a batch of 2 sequences, checkpoint 10): sequence "), report["verdict"]
    assert all(r["status"] != "FAIL" for r in report["rows"] if r is not batch)


@pytest.mark.parametrize("flag, value, block, says", [
    ("scale_attn_by_inverse_layer_idx", True, 1, "where the reference's config sets scale_attn_by_inverse_layer_idx"),
    ("scale_attn_weights", False, 0, "where the reference's config sets scale_attn_weights=False"),
    ("scale_attn_both", None, 0, "sets scale_attn_weights=False and scale_attn_by_inverse_layer_idx=True"),
])
def test_a_reference_with_hfs_attention_options_is_named(flag, value, block, says, tmp_path, capsys):
    """A checkpoint whose config asks for HF's other attention scales: a right GPT-2 failed 'matches no known
    mistake' at the first block they change; the config's flag is named, with the way to follow it."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    flags = ({"scale_attn_weights": False, "scale_attn_by_inverse_layer_idx": True} if value is None
             else {flag: value})
    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=64, **flags)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "ref")
    path = tmp_path / "learner.py"
    path.write_text(NANOGPT)
    code = main(["check", f"{path}:GPT", "--model", str(tmp_path / "ref"), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["diagnosis"]["key"] == f"ref_{flag}", report["verdict"]
    assert report["first_divergence"]["layer"] == block and says in report["verdict"], report["verdict"]


def test_a_one_position_reference_has_no_greedy_tokens(tmp_path):
    """greedy(..., 0) returned the whole prompt (ids[-0:]): with n_positions 1 the reference then ran 2 tokens
    through a 1-position model (an IndexError traceback)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt2ffn.check_model import reference
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=512, n_positions=1)).save_pretrained(
        tmp_path)
    ref = reference(str(tmp_path))
    assert ref.ids == [15496 % 512] and ref.tokens == [] and ref.forced.shape == (1, 1, 512)


@pytest.mark.parametrize("change, says", [
    (None, "PASS: learner.py:GPTLanguageModel computes GPT-2"),
    # the lecture's own scale: C is x's width, n_embd, where the head's is meant
    (("k.shape[-1]**-0.5", "C**-0.5"), "attention scores scaled by 1/sqrt(n_embd) instead of 1/sqrt(d_head)"),
    (("bias=True)", "bias=False)"), "q/k/v bias missing (GPT-2's c_attn has one)"),  # the lecture's heads' as written
])
def test_karpathys_lecture_model_with_a_module_per_head(change, says, tmp_path, capsys):
    """The lecture's MultiHeadAttention runs a ModuleList of Head modules, each with its own key, query and value
    layers of head_size: refused before (3 x n_head layers of [d, d_head] fit no role). Now each role is the heads'
    layers side by side (head h gets GPT-2's columns h * d_head ..), and their outputs concatenated are judged as
    q, k, v; its lm_head's bias is given zeros."""
    source = KARPATHY if change is None else KARPATHY.replace(*change)
    code, out, err = run(tmp_path, capsys, source, "GPTLanguageModel")
    assert code == (0 if change is None else 1), out + err
    assert says in out.splitlines()[-1], out
    assert "lm_head has a bias, which GPT-2's head has not: given zeros" in out
    if change is None:
        assert re.search(r"02 q \(c_attn\) +0-1 +\(1, 6, 64\) .* PASS", out), out


@pytest.mark.parametrize("old, new, says", [
    # minGPT's first GPT: position embeddings as a Parameter of the model's own
    ("            wpe=nn.Embedding(config.block_size, config.n_embd),\n", "",
     "PASS: learner.py:GPT computes GPT-2"),
    # no learned positions at all (RoPE, sinusoids): named at checkpoint 00, not refused
    ("            wpe=nn.Embedding(config.block_size, config.n_embd),\n", "",
     "FAIL (first divergence: embeddings (wte + wpe), checkpoint 00): no learned position embeddings"),
])
def test_position_embeddings_as_a_parameter_or_none(old, new, says, tmp_path, capsys):
    source = NANOGPT.replace(old, new)
    if says.startswith("PASS"):
        source = source.replace("        self.lm_head = nn.Linear(",
                                "        self.pos_emb = nn.Parameter(torch.zeros(1, config.block_size, config.n_embd))"
                                "\n        self.lm_head = nn.Linear(")
        source = source.replace("pos_emb = self.transformer.wpe(pos)", "pos_emb = self.pos_emb[:, :t, :]")
    else:
        source = source.replace("pos_emb = self.transformer.wpe(pos)", "pos_emb = 0")
    code, out, err = run(tmp_path, capsys, source, "GPT")
    assert code == (0 if says.startswith("PASS") else 1), out + err
    assert out.splitlines()[-1].startswith(says), out


def test_a_layer_never_called_and_a_loss_first_tuple(tmp_path, capsys):
    """A LayerNorm the forward never calls was 'not hooked: no module of yours returns it'; a forward returning
    (None, logits) was 'returned no tensor'."""
    code, out, _ = run(tmp_path, capsys, plant("ln_2_for_attn"), "GPT")
    assert code == 1 and "not hooked: transformer.h.0.ln_1 is never called in the forward" in out, out
    source = NANOGPT.replace("logits = self.lm_head(x[:, [-1], :])", "logits = self.lm_head(x)")
    assert "return logits, loss" in source
    code, out, _ = run(tmp_path, capsys, source.replace("return logits, loss", "return None, logits"), "GPT")
    assert code == 0 and out.splitlines()[-1].startswith("PASS"), out


def test_a_square_layer_of_its_own_in_the_other_layout(tmp_path, capsys):
    """c_attn_w [d, 3d] read as x @ W beside a square c_proj_w read through F.linear ([out, in]): the square one's
    layout was taken from its sibling's and the model failed as 'attn.c_proj not transposed'; the other layout
    is tried where the first fails so, and said."""
    old = "return y @ self.c_proj_w + self.c_proj_b"
    assert old in OWN_PARAMS
    code, out, _ = run(tmp_path, capsys, OWN_PARAMS.replace(old, "return F.linear(y, self.c_proj_w, self.c_proj_b)"),
                       "GPT")
    assert code == 0 and "judged in the layout in which they compute GPT-2" in out, out
    code, out, _ = run(tmp_path, capsys, OWN_PARAMS.replace(old, "return F.linear(y, self.c_proj_w)"), "GPT")
    assert code == 1 and "attn.c_proj weight not transposed" not in out.splitlines()[-1], out


def test_review_of_the_second_round(tmp_path, capsys):
    """A model of one sequence at a time (an assert on B) is not failed by the batch row, nor is one keeping the
    first; flattened (B * T, vocab) logits are read for a batch too; the square-layout retry of an instance starts
    from its weights as they came (it saw the first run's copies as its own loader's); the no-wpe diagnosis keeps
    the report's subject; heads holding a weight alone; an lm_head tied to wte with a bias."""
    every = NANOGPT.replace("logits = self.lm_head(x[:, [-1], :])", "logits = self.lm_head(x)")
    one = every.replace("b, t = idx.size()", "b, t = idx.size()\n        assert b == 1")
    code, out, _ = run(tmp_path, capsys, one, "GPT")
    assert code == 0 and out.splitlines()[-1].endswith("; one sequence at a time)"), out
    assert "a model of one sequence at a time: judged on one only (it failed on a batch of 2: AssertionError" in out
    flat = every.replace("logits = self.lm_head(x)", "logits = self.lm_head(x).view(-1, self.config.vocab_size)")
    code, out, _ = run(tmp_path, capsys, flat, "GPT")
    assert code == 0 and out.splitlines()[-1].endswith("and in a batch)"), out
    instance = OWN_PARAMS.replace("return y @ self.c_proj_w + self.c_proj_b",
                                  "return F.linear(y, self.c_proj_w, self.c_proj_b)")
    instance += "\nmodel = GPT(GPTConfig(block_size=128, vocab_size=512, n_layer=2, n_head=4, n_embd=64))\n"
    code, out, _ = run(tmp_path, capsys, instance, "model")
    assert code == 0 and "judged in the layout in which they compute GPT-2" in out, out
    source = NANOGPT.replace("            wpe=nn.Embedding(config.block_size, config.n_embd),\n", "").replace(
        "pos_emb = self.transformer.wpe(pos)", "pos_emb = 0")
    code, out, _ = run(tmp_path, capsys, source, "GPT", "--json")
    assert code == 1 and json.loads(out)["subject"].endswith("learner.py:GPT"), out
    weight_only = KARPATHY.replace("nn.Linear(n_embd, head_size, bias=True)", "Lin(n_embd, head_size)").replace(
        "class Head(nn.Module):", "class Lin(nn.Module):\n    def __init__(self, i, o):\n        super().__init__()\n"
        "        self.weight = nn.Parameter(torch.zeros(o, i))\n\n    def forward(self, x):\n"
        "        return x @ self.weight.T\n\n\nclass Head(nn.Module):")
    code, out, _ = run(tmp_path, capsys, weight_only, "GPTLanguageModel")
    assert code == 1 and "q/k/v bias missing" in out.splitlines()[-1], out
    tied = NANOGPT.replace("self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)",
                           "self.lm_head = nn.Linear(config.n_embd, config.vocab_size)")
    code, out, _ = run(tmp_path, capsys, tied, "GPT")
    assert code == 0 and "lm_head.bias: GPT-2's head has no bias: given zeros" in out, out


def test_a_flattening_mlp_on_quiet_weights_passes(quiet_dir, tmp_path, capsys):
    """On a checkpoint whose prompt cannot tell the FFN's mistakes, block 0's FFN is judged alone on a wider
    input; an MLP that flattens to (B * T, d) (its block reshapes back) passed, then failed there on the new
    batch probe, reported as the scaled input's failure. The model's own batch row judges batches; the FFN
    alone is judged on its input scaled only."""
    source = NANOGPT.replace("        x = self.c_fc(x)\n", "        x = self.c_fc(x.reshape(-1, x.shape[-1]))\n")
    source = source.replace("x = x + self.mlp(self.ln_2(x))", "x = x + self.mlp(self.ln_2(x)).view_as(x)")
    path = tmp_path / "learner.py"
    path.write_text(textwrap.dedent(source))
    code = main(["check", f"{path}:GPT", "--model", str(quiet_dir)])
    out = capsys.readouterr().out
    assert code == 0 and out.splitlines()[-1].startswith("PASS"), out
