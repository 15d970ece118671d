"""What a failing FFN got wrong: every known-wrong variant, computed from the same weights and input.

A failing output "is" a variant when max |got - variant| <= the tolerance it failed (1e-4 by default); the
closest such variant is named with what to change. Each variant is computed in float64 from HF's weights
(HF layout: c_fc.weight [d, hidden]), so it is the mistake alone, not the mistake plus rounding.

Dropout left on at inference cannot be computed (its mask is random): it is recognised by its signature,
a fraction p of the elements exactly 0 and all the others scaled by one factor 1/(1 - p).
"""

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .config import Config
from .reference import gelu_exact, gelu_tanh, relu

STAGES = ("c_fc", "gelu", "ffn")
KEYS = ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias")
TANH_FIX = "use the tanh form, GPT-2's gelu_new: 0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x**3))), " \
           "or F.gelu(x, approximate='tanh')"
EXACT_FIX = "use the exact form: 0.5*x*(1 + erf(x/sqrt(2))), or F.gelu(x)"


SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def tanh_form(coefficient=0.044715, scale=SQRT_2_OVER_PI, power=3, half=0.5, times_x=True):
    """half x (1 + tanh(scale (x + coefficient x^power))): GPT-2's GELU at the defaults, a misprint otherwise
    (times_x=False: the gate alone, x left out)."""
    return lambda h: half * (h if times_x else 1.0) * (1.0 + np.tanh(scale * (h + coefficient * h ** power)))


def erf_form(h):
    """The exact form with erf(x) for erf(x / sqrt(2)): 0.5 x (1 + erf(x)) = gelu_exact(sqrt(2) x) / sqrt(2)."""
    return gelu_exact(math.sqrt(2.0) * np.asarray(h, np.float64)) / math.sqrt(2.0)


def softmax(h):
    e = np.exp(h - h.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def sigmoid_form(h):
    return h / (1.0 + np.exp(-1.702 * h))


# Activation forms a learner writes: key -> (function, short name, what it is, how to get GPT-2's tanh form).
FORMS = {
    "tanh": (gelu_tanh, "tanh GELU", "tanh form, as GPT-2's gelu_new", TANH_FIX),
    "exact": (gelu_exact, "exact GELU (erf)", "exact form (erf), as HF's activation_function='gelu'", TANH_FIX),
    "coefficient": (tanh_form(coefficient=0.055715), "cubic coefficient 0.055715 instead of 0.044715",
                    "tanh form with cubic coefficient 0.055715 (GPT-2's is 0.044715)",
                    "use 0.044715 for the cubic coefficient (seed 002's notes misprint it as 0.055715)"),
    "sqrt2_over_pi": (tanh_form(scale=math.sqrt(2.0) / math.pi), "sqrt(2)/pi instead of sqrt(2/pi)",
                      "tanh form scaled by sqrt(2)/pi instead of sqrt(2/pi)",
                      "scale by sqrt(2/pi) = 0.7979 (math.sqrt(2 / math.pi)), not sqrt(2)/pi = 0.4502"),
    "coefficient_04715": (tanh_form(coefficient=0.04715), "cubic coefficient 0.04715 instead of 0.044715",
                          "tanh form with cubic coefficient 0.04715 (GPT-2's is 0.044715)",
                          "use 0.044715 for the cubic coefficient: a 4 is missing"),
    "coefficient_0044715": (tanh_form(coefficient=0.0044715), "cubic coefficient 0.0044715 instead of 0.044715",
                            "tanh form with cubic coefficient 0.0044715 (GPT-2's is 0.044715)",
                            "use 0.044715 for the cubic coefficient: one zero too many"),
    "scale_0797": (tanh_form(scale=0.797), "sqrt(2/pi) written as 0.797",
                   "tanh form scaled by 0.797 instead of sqrt(2/pi) = 0.7978845608",
                   "write math.sqrt(2 / math.pi), not a rounded 0.797"),
    "sqrt_2pi": (tanh_form(scale=math.sqrt(2.0 * math.pi)), "sqrt(2*pi) instead of sqrt(2/pi)",
                 "tanh form scaled by sqrt(2*pi) = 2.5066 instead of sqrt(2/pi) = 0.7979",
                 "divide: math.sqrt(2 / math.pi), not math.sqrt(2 * math.pi)"),
    "two_over_pi": (tanh_form(scale=2.0 / math.pi), "2/pi instead of sqrt(2/pi)",
                    "tanh form scaled by 2/pi instead of sqrt(2/pi)",
                    "scale by sqrt(2/pi) = 0.7979, not 2/pi = 0.6366: the square root is missing"),
    "no_scale": (tanh_form(scale=1.0), "sqrt(2/pi) left out", "tanh form with sqrt(2/pi) left out",
                 "multiply (x + 0.044715*x**3) by sqrt(2/pi) = 0.7979 inside the tanh"),
    "square": (tanh_form(power=2), "x**2 instead of x**3 inside the tanh",
               "tanh form with 0.044715*x**2 where GPT-2's has 0.044715*x**3",
               "cube x in the tanh's argument: x + 0.044715*x**3, not x**2"),
    "no_half": (tanh_form(half=1.0), "0.5 left out (twice GELU)", "tanh form without its 0.5 (twice GELU)",
                "multiply by 0.5: 0.5*x*(1 + tanh(...))"),
    "no_x": (tanh_form(times_x=False), "x left out (the gate 0.5*(1 + tanh(...)) alone)",
             "gate 0.5*(1 + tanh(...)) alone, not multiplied by x",
             "multiply the gate by x: 0.5*x*(1 + tanh(...))"),
    "erf_no_sqrt2": (erf_form, "erf(x) instead of erf(x/sqrt(2))", "exact form with erf(x) instead of erf(x/sqrt(2))",
                     TANH_FIX + " (the exact form, not GPT-2's, divides x by sqrt(2) inside erf)"),
    "sigmoid": (sigmoid_form, "sigmoid approximation x*sigmoid(1.702x) instead of GELU",
                "sigmoid approximation x*sigmoid(1.702x)", TANH_FIX),
    "relu": (relu, "ReLU instead of GELU", "ReLU", TANH_FIX),
    "twice": (lambda h: gelu_tanh(gelu_tanh(h)), "GELU applied twice", "tanh GELU applied twice, gelu(gelu(x))",
              "apply GELU once, between c_fc and c_proj"),
    "identity": (lambda h: h, "GELU left out", "no activation (identity)",
                 "apply GELU between c_fc and c_proj: c_proj(gelu(c_fc(x)))"),
}
# Config.gelu_approximate -> the form it asks for.
TARGET = {"tanh": "tanh", "none": "exact", "relu": "relu"}


def fix_for(key: str, target: str) -> str:
    """What to change when the activation is form `key` and the config asks for form `target`."""
    if target == "tanh" or key == "identity":
        return FORMS[key][3]
    return f"use the config's activation, the {FORMS[target][2]}" + (f": {EXACT_FIX}" if target == "exact" else "")


@dataclass
class Variant:
    """One known-wrong FFN: a key to test by, its name, what to change, and its output at every stage."""

    key: str
    name: str
    fix: str
    stages: dict = field(repr=False)


@dataclass
class Diagnosis:
    """What a failing stage output is: a variant (key, name, fix), dropout, or none (with the worst element)."""

    stage: str
    key: str | None
    text: str
    distance: float = float("nan")

    def as_dict(self):
        return dict(self.__dict__)


def forward(x, w1, b1, w2, b2, act) -> dict:
    """Every stage of c_fc -> act -> c_proj, float64."""
    h = x @ w1 + b1          # (..., d) -> (..., hidden)
    g = act(h)               # (..., hidden)
    return {"c_fc": h, "gelu": g, "ffn": g @ w2 + b2}   # (..., hidden) -> (..., d)


def variants(x, weights: dict, approximate: str = "tanh", resid=None, width=None) -> list:
    """Every known-wrong FFN on input x (the ln_2 output), from GPT2MLP-keyed weights in HF layout.

    resid, the residual stream ln_2 normalised, adds the variant "fed the residual stream"; width, a learner's
    narrower hidden width other than half, the variant of that width (the first `width` units)."""
    x = np.asarray(x, np.float64)
    w1, b1, w2, b2 = (np.asarray(weights[k], np.float64) for k in KEYS)
    d, hidden = w1.shape
    target = TARGET[approximate]
    act = FORMS[target][0]
    out = []

    def add(key, name, fix, stages):
        out.append(Variant(key, name, fix, stages))

    for key, (f, short, _, _) in FORMS.items():
        if key == target:
            continue
        said = "ReLU" if target == "relu" else FORMS[target][1]
        name = f"{short} where the config says {said}" if key in ("tanh", "exact") else short
        add(f"gelu_{key}", name, fix_for(key, target), forward(x, w1, b1, w2, b2, f))
    half = hidden // 2
    times = (lambda n: f" ({n / d:g}x n_embd)") if hidden % d == 0 else (lambda n: "")
    add("expansion_2x", f"hidden width {half}{times(half)} instead of {hidden}{times(hidden).replace(' n_embd', '')}",
        f"expand to the full hidden width: nn.Linear(emb_dim, {hidden // d if hidden % d == 0 else hidden} * emb_dim)"
        if hidden % d == 0 else f"use hidden width {hidden}",
        forward(x, w1[:, :half], b1[:half], w2[:half], b2, act))
    if width is not None and width < hidden and width != half:
        add("hidden_width",
            f"hidden width {width}{times(width)} instead of {hidden}{times(hidden).replace(' n_embd', '')}",
            f"use hidden width {hidden}" + (f": nn.Linear(emb_dim, {hidden // d} * emb_dim), not a fixed number"
                                            if hidden % d == 0 else ""),
            forward(x, w1[:, :width], b1[:width], w2[:width], b2, act))
    layouts = {
        "c_fc": (w1, "[n_embd, hidden]", lambda w: forward(x, w, b1, w2, b2, act)),
        "c_proj": (w2, "[hidden, n_embd]", lambda w: forward(x, w1, b1, w, b2, act)),
    }
    for layer, (w, shape, run) in layouts.items():
        n_in, n_out = w.shape
        fix = (f"transpose {layer}: GPT-2's Conv1D stores {layer}.weight as [in, out] = {shape}, nn.Linear as "
               f"[out, in]; copy {layer}.weight.T into nn.Linear.weight (a reshape or view is not a transpose)")
        add(f"{layer}_not_transposed", f"{layer} weight not transposed ([in, out] data read as [out, in])", fix,
            run(w.reshape(n_out, n_in).T))
        add(f"{layer}_viewed", f"{layer} weight not transposed ([out, in] weight viewed as [in, out])", fix,
            run(w.T.reshape(n_in, n_out)))
    (i1, o1), (i2, o2) = w1.shape, w2.shape  # a learner who mis-loads one matrix mostly mis-loads both
    fix = ("transpose both: GPT-2's Conv1D stores c_fc.weight and c_proj.weight as [in, out], nn.Linear as [out, in]; "
           "copy each weight.T into nn.Linear.weight (a reshape or view is not a transpose)")
    add("both_not_transposed", "c_fc and c_proj weights not transposed ([in, out] data read as [out, in])", fix,
        forward(x, w1.reshape(o1, i1).T, b1, w2.reshape(o2, i2).T, b2, act))
    add("both_viewed", "c_fc and c_proj weights not transposed ([out, in] weights viewed as [in, out])", fix,
        forward(x, w1.T.reshape(i1, o1), b1, w2.T.reshape(i2, o2), b2, act))
    linear = forward(x, w1, b1, w2, b2, lambda h: h)
    add("gelu_after_c_proj", "GELU applied after c_proj instead of between c_fc and c_proj",
        "c_proj(gelu(c_fc(x))): the activation goes between the two linear layers, not after the second",
        {"c_fc": linear["c_fc"], "gelu": linear["c_fc"], "ffn": act(linear["ffn"])})
    right = forward(x, w1, b1, w2, b2, act)
    add("gelu_also_after_c_proj", "GELU applied after c_proj as well as between c_fc and c_proj",
        "return c_proj's output as it is: GPT-2's FFN has one activation, between the two linear layers",
        {**right, "ffn": act(right["ffn"])})
    add("softmax_activation", "softmax over the hidden units instead of GELU",
        "apply GELU elementwise between c_fc and c_proj, not a softmax over the hidden units",
        forward(x, w1, b1, w2, b2, softmax))
    add("c_fc_bias_missing", "c_fc bias missing", "add c_fc's bias (nn.Linear(..., bias=True), GPT-2 has one)",
        forward(x, w1, 0 * b1, w2, b2, act))
    add("c_proj_bias_missing", "c_proj bias missing", "add c_proj's bias (nn.Linear(..., bias=True), GPT-2 has one)",
        forward(x, w1, b1, w2, 0 * b2, act))
    add("biases_missing", "both biases missing (c_fc and c_proj)", "give both linear layers a bias (bias=True)",
        forward(x, w1, 0 * b1, w2, 0 * b2, act))
    add("residual_added", "residual added inside the FFN (returns x + FFN(x))",
        "return c_proj's output; the block adds the residual: x = x + mlp(ln_2(x))", {**right, "ffn": x + right["ffn"]})
    if resid is not None:
        add("residual_input", "FFN fed the residual stream instead of ln_2's output",
            "feed the FFN ln_2's output: x = x + mlp(ln_2(x)), not mlp(x)",
            forward(np.asarray(resid, np.float64), w1, b1, w2, b2, act))
    return out


def _within(stages: dict, expected: dict, atol: float) -> bool:
    """Whether every stage of a known mistake equals the expected one within atol (the set cannot tell them)."""
    for k, v in stages.items():
        v, e = np.asarray(v), np.asarray(expected[k])
        if v.shape != e.shape or not float(np.abs(v - e).max(initial=0.0)) <= atol:
            return False
    return True


def blind_to(case, atol: float) -> list:
    """The known FFN mistakes this case's (FFNCase) input cannot tell from the right FFN within atol (names)."""
    return [v.name for v in case.known if _within(v.stages, case.expected, atol)]


def local_variants(stage: str, inp, x, weights: dict, approximate: str, known: list) -> tuple:
    """(what the stage computes from its own input, the known mistakes of that stage alone): the activation
    applied to the module's own c_fc output, c_proj to its own activation output. A stage that is right given
    its own input only inherits an earlier mistake; one that is wrong holds a mistake of its own, so a module
    with two (no biases and ReLU) has each named. x: the FFN's input, for the residual added inside it."""
    inp = np.asarray(inp, np.float64)
    names = {v.key: (v.name, v.fix) for v in known}
    if stage == "gelu":
        target = TARGET[approximate]
        right = FORMS[target][0](inp)
        tensors = {f"gelu_{k}": f(inp) for k, (f, *_) in FORMS.items() if k != target}
    else:  # ffn: c_proj of the module's own activation output
        w2, b2 = (np.asarray(weights[k], np.float64) for k in ("c_proj.weight", "c_proj.bias"))
        w2 = w2[:inp.shape[-1]]  # a narrower hidden width: the rows of c_proj it was loaded with
        n_in, n_out = w2.shape
        right = inp @ w2 + b2
        tensors = {"c_proj_bias_missing": inp @ w2, "c_proj_not_transposed": inp @ w2.reshape(n_out, n_in).T + b2,
                   "c_proj_viewed": inp @ w2.T.reshape(n_in, n_out) + b2,
                   "residual_added": np.asarray(x, np.float64) + right}
    return right, [Variant(k, *names[k], {stage: t}) for k, t in tensors.items() if k in names]


def _fit(got, shape):
    """got reshaped to shape when only leading 1s differ ([T, d] for [1, T, d]); else None."""
    squeeze = lambda s: tuple(s)[next((i for i, n in enumerate(s) if n != 1), len(s)):]  # noqa: E731
    return got.reshape(shape) if squeeze(got.shape) == squeeze(shape) else None


def dropout_rate(got, expected, atol):
    """p when got is expected under dropout (a fraction p exactly 0, the rest scaled by 1/(1 - p)); else None."""
    live = np.abs(expected) > atol
    if got.shape != expected.shape or live.sum() < 100:
        return None
    zero = (got == 0) & live
    kept = live & ~zero
    if not 0.01 <= zero.sum() / live.sum() <= 0.9:
        return None
    scale = float(np.median(got[kept] / expected[kept]))
    fits = np.abs(got[kept] - scale * expected[kept]) <= atol + 1e-4 * np.abs(expected[kept])
    p = 1 - 1 / scale
    if fits.mean() < 0.99 or abs(p - zero.sum() / live.sum()) > 0.1:
        return None
    return p


def matching(stage: str, got, known: list, atol: float, right=None) -> list:
    """(max |got - variant|, variant) for every known variant the stage output equals within atol, closest first.
    right: the stage's right output, where known: a variant within atol of it is not told apart from it there
    (c_proj's layout at the activation, under a tight --atol), so it is never named."""
    got = np.asarray(got, np.float64)
    right = None if right is None else np.asarray(right, np.float64)
    found = []
    for v in known:
        want = v.stages.get(stage)
        g = _fit(got, want.shape) if want is not None else None
        if g is not None and (dist := float(np.abs(g - want).max())) <= atol and (
                right is None or right.shape != want.shape or float(np.abs(right - want).max()) > atol):
            found.append((dist, v))
    return sorted(found, key=lambda f: f[0])


def named(v: Variant, stage: str, dist: float) -> Diagnosis:
    """The diagnosis that a stage output is variant v: its name, how close, and what to change."""
    return Diagnosis(stage, v.key, f"{v.name} (within {dist:.1e} of it): {v.fix}", dist)


def diagnose(stage: str, got, expected, known: list, atol: float) -> Diagnosis:
    """Name the known-wrong variant a failing stage output equals (within atol), or say that none does."""
    got = np.asarray(got, np.float64)
    found = matching(stage, got, known, atol, expected)
    if found:
        return named(found[0][1], stage, found[0][0])
    expected = np.asarray(expected, np.float64)
    g = _fit(got, expected.shape)
    if g is None:
        return Diagnosis(stage, None, f"shape {tuple(got.shape)} matches no known mistake (expected "
                                      f"{tuple(expected.shape)})")
    p = dropout_rate(g, expected, atol)
    if p is not None:
        return Diagnosis(stage, "dropout", f"dropout active at inference: {p:.0%} of the elements are 0 and the rest "
                                           f"scaled by {1 / (1 - p):.4f} = 1/(1 - p): call model.eval(), and use "
                                           "nn.Dropout or F.dropout(x, p, training=self.training)")
    diff = np.abs(g - expected)
    i = np.unravel_index(int(np.argmax(diff)), diff.shape)
    return Diagnosis(stage, None, f"matches no known mistake; worst element {list(map(int, i))}: got "
                                  f"{g[i]:.6g}, expected {expected[i]:.6g}", float(diff[i]))


@dataclass
class FFNCase:
    """One block's FFN as HF computed it: weights (HF layout), input (ln_2 output), residual stream, stages."""

    source: str
    layer: int
    approximate: str
    weights: dict       # c_fc.weight [d, hidden], c_fc.bias, c_proj.weight [hidden, d], c_proj.bias: numpy
    x: np.ndarray       # ln_2 output (1, T, d), the FFN's input
    resid: np.ndarray   # the residual stream ln_2 normalised (1, T, d)
    expected: dict      # c_fc, gelu, ffn as HF's modules returned them
    width: int | None = None  # a learner's narrower hidden width: its variant is known too
    _known: list = field(default=None, repr=False)
    _own: dict = field(default=None, repr=False)  # the stages its weights and config compute (telling)

    @property
    def known(self) -> list:
        if self._known is None:
            self._known = variants(self.x, self.weights, self.approximate, self.resid, self.width)
        return self._known

    def diagnose(self, stage, got, atol) -> Diagnosis:
        return diagnose(stage, got, self.expected[stage], self.telling(stage, atol), atol)

    def matching(self, stage, got, atol) -> list:
        return matching(stage, got, self.telling(stage, atol), atol, self.expected.get(stage))

    def telling(self, stage, atol) -> list:
        """The known variants that change this stage from what the FFN's own weights and config compute (c_proj's
        layout does not, at the activation): one that does not is never named there, or a set whose stored
        tensors disagree with its own config (an edited manifest) would have it blamed."""
        if self._own is None:
            self._own = forward(np.asarray(self.x, np.float64), *(np.asarray(self.weights[k], np.float64)
                                                                    for k in KEYS), FORMS[TARGET[self.approximate]][0])
        own = self._own.get(stage)
        return [v for v in self.known if own is None or stage not in v.stages or own.shape != v.stages[stage].shape
                or float(np.abs(own - v.stages[stage]).max()) > atol]

    def local(self, stage, inp, got, atol):
        """(True when the stage is right given its own input inp, the known mistakes it equals given inp)."""
        right, known = local_variants(stage, inp, self.x, self.weights, self.approximate, self.known)
        g = _fit(np.asarray(got, np.float64), right.shape)
        ok = g is not None and float(np.abs(g - right).max()) <= atol
        return ok, ([] if ok else matching(stage, got, known, atol, right))

    def given(self, x) -> "FFNCase":
        """The same FFN fed another input (an engine's own ln_2 output): expected is the right FFN of x."""
        w = [np.asarray(self.weights[k], np.float64) for k in KEYS]
        right = forward(np.asarray(x, np.float64), *w, FORMS[TARGET[self.approximate]][0])
        return FFNCase(self.source, self.layer, self.approximate, self.weights, x, None, right)


# ---- the known mistakes of a whole block (attention, layer norms, residuals), computed in float64 ----------

def layer_norm(x, w, b, eps, unbiased=False, std_eps=False, no_sqrt=False):
    """GPT-2's LayerNorm; unbiased: the variance divided by n - 1; std_eps: (x - mean) / (std + eps), eps
    outside the square root (the std unbiased when `unbiased`, as torch.std's default); no_sqrt: divided by
    var + eps itself."""
    mu = x.mean(-1, keepdim=True)
    if no_sqrt:
        return (x - mu) / (x.var(-1, keepdim=True, unbiased=False) + eps) * w + b
    if std_eps:
        return (x - mu) / (x.std(-1, keepdim=True, unbiased=unbiased) + eps) * w + b
    return (x - mu) / torch.sqrt(x.var(-1, keepdim=True, unbiased=unbiased) + eps) * w + b


def _act(approximate):
    return (lambda h: torch.relu(h)) if approximate == "relu" else (lambda h: F.gelu(h, approximate=approximate))


EPS_TRIED = (1e-12, 1e-8, 1e-6, 1e-5, 1e-3)
# key -> (name, what to change). Each is computed from HF's weights and HF's input to the block (float64).
MISTAKES = {
    "no_scale": ("attention scores not scaled by 1/sqrt(d_head)",
                 "divide q @ k^T by math.sqrt(d_head), d_head = n_embd // n_head, before the mask and softmax"),
    "scale_n_embd": ("attention scores scaled by 1/sqrt(n_embd) instead of 1/sqrt(d_head)",
                     "divide by math.sqrt(n_embd // n_head), the head's width, not the model's"),
    "no_mask": ("no causal mask: each position attends to later tokens",
                "before the softmax set the scores of keys after the query to -inf: "
                "att.masked_fill(torch.tril(torch.ones(T, T)) == 0, float('-inf'))"),
    "inverted_mask": ("causal mask inverted: each position attends to itself and later tokens, not earlier ones",
                      "mask the keys AFTER the query (the upper triangle, torch.triu(..., diagonal=1)), "
                      "keep the lower"),
    "softmax_axis": ("softmax over the wrong axis (dim=-2, the queries) instead of the keys (dim=-1)",
                     "torch.softmax(att, dim=-1): each query's weights over the keys sum to 1"),
    "ln_unbiased": ("LayerNorm with unbiased variance (divides by n - 1)",
                    "x.var(dim=-1, keepdim=True, unbiased=False), or nn.LayerNorm: GPT-2 divides by n"),
    "post_norm": ("post-norm: LayerNorm after the residual add (x = ln(x + attn(x))) instead of before the sublayer",
                  "GPT-2 is pre-norm: x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))"),
    "no_resid_attn": ("missing residual around attention (x = attn(ln_1(x)))", "x = x + attn(ln_1(x))"),
    "no_resid_mlp": ("missing residual around the FFN (x = mlp(ln_2(x)))", "x = x + mlp(ln_2(x))"),
    "c_attn_not_transposed": ("c_attn weight not transposed ([in, out] Conv1D data used as [out, in])",
                              "GPT-2's Conv1D stores c_attn.weight as [in, out]; copy its .T into nn.Linear.weight "
                              "(a reshape or view is not a transpose)"),
    "attn_c_proj_not_transposed": ("attn.c_proj weight not transposed ([in, out] Conv1D data used as [out, in])",
                                   "GPT-2's Conv1D stores attn.c_proj.weight as [in, out]: copy its .T into "
                                   "nn.Linear.weight, or compute x @ W for a Conv1D-layout W"),
    "qkv_bias_missing": ("q/k/v bias missing (GPT-2's c_attn has one)",
                         "build the q, k, v projections with bias=True (the book's qkv_bias=True when loading GPT-2)"),
    "mask_off_by_one": ("causal mask off by one: each position also attends to the next token",
                        "mask every key after the query: torch.triu(ones(T, T), diagonal=1), not diagonal=2"),
    "mask_excludes_self": ("causal mask hides each position from itself (keys j < i only, not j <= i)",
                           "mask only the keys after the query: torch.triu(ones(T, T), diagonal=1), so the diagonal "
                           "stays visible"),
    "mask_after_softmax": ("mask applied after the softmax (future weights zeroed, the rest not renormalized)",
                           "fill the scores of future keys with -inf before the softmax"),
    "heads_not_merged": ("heads not merged back: (H, T, d_head) reshaped to (T, d) without moving the head axis",
                         "y.transpose(0, 1).reshape(T, n_embd) (torch: y.transpose(1, 2).contiguous().view(B, T, C)): "
                         "token t's row holds every head's output for t"),
    "q_k_swapped": ("q and k swapped: c_attn's output split as k, q, v, or the scores computed as k @ q^T",
                    "split c_attn's output in GPT-2's order, q, k, v = qkv.split(n_embd, dim=-1), and score q @ "
                    "k.transpose(-2, -1) (einsum 'bhqd,bhkd->bhqk': query rows, key columns)"),
    "ln_std_eps": ("LayerNorm as (x - mean) / (std + eps), with torch.std's unbiased default",
                   "(x - mean) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + eps), or nn.LayerNorm"),
    "ln_std_eps_biased": ("LayerNorm with eps outside the square root: (x - mean) / (std + eps)",
                          "(x - mean) / torch.sqrt(var + eps): eps goes under the square root, or nn.LayerNorm"),
    "heads_interleaved": ("heads split wrongly: q/k/v reshaped as (T, d_head, n_head), head index fastest",
                          "split each of q, k, v into heads as t.view(T, n_head, d_head).transpose(0, 1): head h is "
                          "columns h*d_head .. (h+1)*d_head - 1"),
    "qkv_per_head": ("c_attn's output split per head first: viewed as (T, n_head, 3 * d_head), then q, k, v of each "
                     "head", "split it into q, k, v first (qkv.split(n_embd, dim=-1): q is columns 0 .. n_embd - 1), "
                     "then each into heads"),
    "mask_zero_fill": ("causal mask fills the future scores with 0, not -inf: they still get softmax weight",
                       "att.masked_fill(mask, float('-inf')): a score of 0 is exp(0) = 1 after the softmax"),
    "ln_no_sqrt": ("LayerNorm divides by var + eps, without the square root",
                   "(x - mean) / torch.sqrt(var + eps), or nn.LayerNorm"),
    "resid_normed": ("the residual adds the normalized x: x = ln_1(x) + attn(ln_1(x))",
                     "the residual carries x itself: x = x + attn(ln_1(x))"),
    "ln_2_for_attn": ("attention fed ln_2(x): the block's second LayerNorm where its first, ln_1, belongs",
                      "x = x + attn(ln_1(x)); x = x + mlp(ln_2(x)): each sublayer its own LayerNorm"),
    "scale_d_head": ("attention scores scaled by 1/d_head instead of 1/sqrt(d_head)",
                     "divide q @ k^T by math.sqrt(d_head) (F.scaled_dot_product_attention's default scale), not by "
                     "d_head"),
    "softmax_heads": ("softmax over the heads axis (dim=1 of (B, n_head, T, T)) instead of the keys (dim=-1)",
                      "torch.softmax(att, dim=-1): each query's weights over the keys sum to 1"),
    "mask_after_softmax_inf": ("mask applied after the softmax, filling the future weights with -inf",
                               "fill the scores of future keys with -inf before the softmax, not its output"),
    "heads_reshaped": ("heads split with a reshape alone: (T, n_embd) viewed as (n_head, T, d_head), no transpose",
                       "q.view(B, T, n_head, d_head).transpose(1, 2): a reshape to (B, n_head, T, d_head) mixes the "
                       "tokens and the heads"),
    "mask_keeps_future": ("causal mask inverted, the diagonal masked too: each position attends only to later "
                          "tokens (nn.MultiheadAttention's attn_mask given tril where True means masked)",
                          "mask the keys after the query: nn.MultiheadAttention's bool attn_mask is True where "
                          "attention is NOT allowed, torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)"),
    "mask_float_01": ("a float 0/1 mask added to the scores: nn.MultiheadAttention adds a float attn_mask, so 1 "
                      "where allowed and 0 where not masks nothing",
                      "give a bool mask (True where not allowed: torch.triu(ones, diagonal=1).bool()), or a float "
                      "one of 0 where allowed and -inf where not"),
}
# Mistakes whose stages hold NaN or Inf as a learner's do (a row of -inf softmaxed, or -inf left in the
# probabilities): matched where the learner's non-finite values are the same ones, on the rest.
NON_FINITE = ("softmax_heads", "mask_after_softmax_inf", "mask_keeps_future")
# Mistakes of the model outside its blocks: key -> (name, what to change).
MODEL_MISTAKES = {
    "positions_not_added": ("position embeddings not added (wte only)", "x = wte(idx) + wpe(torch.arange(T))"),
    "no_wpe": ("no learned position embeddings: GPT-2 adds wpe, a learned (n_positions, n_embd) table, to the token "
               "embeddings (RoPE or sinusoidal positions are not GPT-2's)",
               "self.wpe = nn.Embedding(n_positions, n_embd); x = wte(idx) + wpe(torch.arange(T))"),
    "positions_from_1": ("positions counted from 1 (wpe[1 .. T]) instead of 0",
                         "x = wte(idx) + wpe(torch.arange(T)): the first token's position is 0"),
    "no_ln_f": ("ln_f not applied: the last block's output taken as is", "x = ln_f(x) after the last block"),
    "logits_without_ln_f": ("logits computed without ln_f (last block's output @ wte^T)",
                            "logits = ln_f(x) @ wte.weight.T"),
    "lm_head_as_d_by_vocab": ("the LM head read as [d, vocab]: wte's (vocab, d) data used as a (d, vocab) matrix",
                              "logits = ln_f(x) @ wte.T: wte is (vocab, d), row i token i's embedding"),
    "ref_scale_attn_by_inverse_layer_idx": (
        "GPT-2's attention scale, where the reference's config sets scale_attn_by_inverse_layer_idx=True (HF then "
        "divides block i's scores by i + 1 as well: the Stanford CRFM GPT-2s)",
        "the checkpoint asks for it: divide block i's q @ k^T by (i + 1) too, or judge against a checkpoint without "
        "the flag"),
    "ref_scale_attn_weights": (
        "scores scaled by 1/sqrt(d_head), where the reference's config sets scale_attn_weights=False (HF then does "
        "not scale them)", "the checkpoint asks for unscaled scores: leave out the 1/sqrt(d_head), or judge against a "
        "checkpoint without the flag"),
    "ref_scale_attn_both": (
        "GPT-2's attention scale, where the reference's config sets scale_attn_weights=False and "
        "scale_attn_by_inverse_layer_idx=True (HF then divides block i's unscaled scores by i + 1)",
        "the checkpoint asks for it: q @ k^T / (i + 1) in block i, without 1/sqrt(d_head), or judge against a "
        "checkpoint without the flags"),
    "ids_off_by_one": ("token ids off by one: wte rows ids + 1 (or - 1) looked up", "x = wte[ids] + wpe[0 .. T - 1], "
                       "the ids exactly as token_ids.txt gives them"),
}
for _eps in EPS_TRIED:
    MISTAKES[f"ln_eps_{_eps:g}"] = (f"LayerNorm eps {_eps:g}", "use GPT-2's eps, 1e-5 (nn.LayerNorm's default)")


def layer_norm_mistakes(x, w, b, eps: float):
    """(key, output) of each known-wrong LayerNorm (MISTAKES' ln_ keys) on x, float64: one LayerNorm judged
    alone on its own input."""
    x = torch.as_tensor(np.asarray(x), dtype=torch.float64)
    yield "ln_unbiased", layer_norm(x, w, b, eps, True)
    yield "ln_std_eps", layer_norm(x, w, b, eps, True, True)
    yield "ln_std_eps_biased", layer_norm(x, w, b, eps, False, True)
    yield "ln_no_sqrt", layer_norm(x, w, b, eps, no_sqrt=True)
    for e in EPS_TRIED:
        if e != eps:
            yield f"ln_eps_{e:g}", layer_norm(x, w, b, e)


def block_forward(x, w: dict, cfg: Config, mistake=None, layer=0) -> dict:
    """Every stage of GPT-2 block `layer` (HF weights w, HF layout) on x, float64, with one known mistake planted."""
    d, H, T = cfg.n_embd, cfg.n_head, x.shape[1]
    dh = d // H
    eps, unbiased = cfg.layer_norm_epsilon, mistake in ("ln_unbiased", "ln_std_eps")
    if mistake and mistake.startswith("ln_eps_"):
        eps = float(mistake.removeprefix("ln_eps_"))
    ln = lambda t, k: layer_norm(t, w[f"{k}.weight"], w[f"{k}.bias"], eps, unbiased,  # noqa: E731
                                 mistake in ("ln_std_eps", "ln_std_eps_biased"), mistake == "ln_no_sqrt")
    act = _act(cfg.gelu_approximate)

    def attn(h):
        wa, ba = w["attn.c_attn.weight"], w["attn.c_attn.bias"]
        if mistake == "c_attn_not_transposed":
            wa = wa.reshape(3 * d, d).T
        if mistake == "qkv_bias_missing":
            ba = 0 * ba
        c_attn = h @ wa + ba                                                   # (1, T, 3d)
        q, k, v = c_attn.split(d, -1)                                          # (1, T, d) each
        if mistake == "qkv_per_head":  # (1, T, H, 3 dh) split on the last axis, each head's q | k | v
            q, k, v = (t.reshape(1, T, d) for t in c_attn.reshape(1, T, H, 3 * dh).split(dh, -1))
        if mistake == "q_k_swapped":
            q, k = k, q
        heads = lambda t: t.reshape(1, T, H, dh).transpose(1, 2)               # noqa: E731  (1, H, T, dh)
        if mistake == "heads_interleaved":
            heads = lambda t: t.reshape(1, T, dh, H).permute(0, 3, 1, 2)       # noqa: E731
        split = (lambda t: t.reshape(1, H, T, dh)) if mistake == "heads_reshaped" else heads  # noqa: E731
        right = cfg.attn_scale(layer)
        scale = {"no_scale": 1.0, "scale_n_embd": 1 / math.sqrt(d), "scale_d_head": 1 / dh}.get(
            mistake, 1 / math.sqrt(dh) if right is None else right)
        att = split(q) @ split(k).transpose(-1, -2) * scale                    # (1, H, T, T)
        i = torch.arange(T)
        mask = {"no_mask": None, "inverted_mask": i[None, :] < i[:, None],
                "mask_excludes_self": i[None, :] >= i[:, None], "mask_keeps_future": i[None, :] <= i[:, None],
                "mask_off_by_one": i[None, :] > i[:, None] + 1}.get(mistake, i[None, :] > i[:, None])
        if mistake == "mask_float_01":
            att = att + (i[None, :] <= i[:, None]).to(att.dtype)
        elif mask is not None and mistake not in ("mask_after_softmax", "mask_after_softmax_inf"):
            att = att.masked_fill(mask, 0.0 if mistake == "mask_zero_fill" else float("-inf"))
        p = torch.softmax(att, dim={"softmax_axis": -2, "softmax_heads": 1}.get(mistake, -1))
        if mistake in ("mask_after_softmax", "mask_after_softmax_inf"):
            p = p.masked_fill(mask, 0.0 if mistake == "mask_after_softmax" else float("-inf"))
        elif mistake == "mask_excludes_self":  # the first query sees nothing: its weights 0 (an engine's NaN there
            # is a non-finite row, reported as such)
            p = torch.nan_to_num(p, nan=0.0)
        ctx = (p @ split(v)).reshape(1, T, d) if mistake == "heads_not_merged" else \
            (p @ split(v)).transpose(1, 2).reshape(1, T, d)
        wp = w["attn.c_proj.weight"].T if mistake == "attn_c_proj_not_transposed" else w["attn.c_proj.weight"]
        return {"c_attn": c_attn, "q": q, "k": k, "v": v, "q_heads": split(q), "k_heads": split(k),
                "v_heads": split(v), "attn_probs": p, "attn_out": ctx @ wp + w["attn.c_proj.bias"]}

    def mlp(h):
        c_fc = h @ w["mlp.c_fc.weight"] + w["mlp.c_fc.bias"]
        g = act(c_fc)
        return {"c_fc": c_fc, "gelu": g, "ffn": g @ w["mlp.c_proj.weight"] + w["mlp.c_proj.bias"]}

    if mistake == "post_norm":
        a = attn(x)
        h1 = ln(x + a["attn_out"], "ln_1")
        m = mlp(h1)
        out = ln(h1 + m["ffn"], "ln_2")
        return {"ln_1": h1, **a, "attn_resid": h1 + m["ffn"], "ln_2": out, **m, "block": out}
    h1 = ln(x, "ln_2" if mistake == "ln_2_for_attn" else "ln_1")
    a = attn(h1)
    r = a["attn_out"] if mistake == "no_resid_attn" else (h1 if mistake == "resid_normed" else x) + a["attn_out"]
    h2 = ln(r, "ln_2")
    m = mlp(h2)
    return {"ln_1": h1, **a, "attn_resid": r, "ln_2": h2, **m,
            "block": m["ffn"] if mistake == "no_resid_mlp" else r + m["ffn"]}
