"""Check a learner's FFN or GELU against GPT-2: PASS/FAIL per stage, and what is wrong, by name.

    gpt2ffn check my_gpt.py:FeedForward                 # a class, built with GPT_CONFIG_124M
    gpt2ffn check my_gpt.py:ffn --golden golden/        # an instance, fed a golden set's ln_2 output
    print(gpt2ffn.check(FeedForward).format())          # the same from Python: a Report

An FFN (a module with two linear layers) gets one GPT-2 block's c_fc and c_proj weights loaded into its
layers, runs in eval() on that block's ln_2 output, and each stage that can be hooked (after the first linear,
the second linear's input, the output) is compared with what HF's own modules returned; a failing stage is
diagnosed (gpt2ffn.diagnose). A GELU (a module or function with no linear layer) runs over a grid and is told
which form it computes.
"""

import contextlib
import copy
import dataclasses
import inspect
import re
import sys
import types
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from .check_model import (
    DEFAULT_MODEL,
    LINEAR_HINTS,
    TOKEN_IDS,
    ModelReport,
    OwnLinear,
    block_function_mistake,
    check_model,
    check_model_function,
    ffn_case,
    find_structure,
    is_model,
    is_model_function,
    model_source,
    own_linears,
    runs_alone,
    square,
)
from .check_model import Row as ModelRow
from .check_model import reference as model_reference
from .config import Config
from .diagnose import FORMS, STAGES, TARGET, Diagnosis, FFNCase, blind_to, fix_for, named
from .errors import Gpt2ffnError
from .learner import CheckError, build, load_object, super_message, super_missing
from .linear import packed_precisions, unpacked_copy
from .model import parse_random
from .tolerances import GOLDEN_ATOL, GOLDEN_SCALED

__all__ = ["CheckError", "Report", "Row", "check", "check_ffn", "check_function", "check_gelu", "load_object"]

DEFAULT_REFERENCE = DEFAULT_MODEL
GPT2_WIDTHS = (768, 1024, 1280, 1600)
STAGE_LABELS = {"c_fc": "after c_fc (1st linear)", "gelu": "after activation", "ffn": "output"}
# Seed 000's spot check of its GELU, to 4 decimals.
SPOT_X = [-2.0, -1.0, 0.0, 1.0, 2.0]
SPOT_Y = [-0.0454, -0.1588, 0.0, 0.8412, 1.9546]
# -10..10 every 0.005 (the 0.01 steps and the points between them: a table of 0.01 steps passed on its own knots),
# and |x| from 10.25 to 400 (a GELU wrong only there passed, 199.5 off)
_FAR = np.geomspace(10.25, 400.0, 48)
GELU_GRID = np.concatenate([np.linspace(-10.0, 10.0, 2001), np.linspace(-9.995, 9.995, 2000), -_FAR[::-1], _FAR])
GELU_GRID = GELU_GRID.astype(np.float32).astype(np.float64)  # the points as the float32 GELU is fed them
# A GELU "is" a form within this: fp32 rounding of a right one is ~2.4e-7; tanh and exact differ by 4.7e-4.
FORM_ATOL = 1e-5


@dataclass
class Row:
    """One judged line: an FFN stage or a GELU measurement."""

    name: str
    shape: tuple
    max_abs: float
    atol: float | None   # None: shown for information, not judged
    status: str          # PASS, FAIL, or "--" for information
    note: str = ""

    def as_dict(self):
        return {**self.__dict__, "shape": list(self.shape)}


@dataclass
class Report:
    """A check's outcome. kind is 'ffn' or 'gelu'; verdict is the one-line conclusion."""

    kind: str
    subject: str
    info: list
    rows: list
    verdict: str
    diagnosis: Diagnosis | None = None   # the most upstream mistake
    diagnoses: list = field(default_factory=list)   # every mistake named, most upstream first
    passed: bool = field(init=False)

    def __post_init__(self):
        self.passed = all(r.status != "FAIL" for r in self.rows)

    def format(self) -> str:
        w = max(len(r.name) for r in self.rows) + 2
        head = f"{'stage' if self.kind == 'ffn' else 'measure':<{w}}{'shape':<16}{'max abs':>11}{'tol':>9}  result"
        lines = [f"{self.kind.upper()} check of {self.subject}", *[f"  {i}" for i in self.info], head, "-" * len(head)]
        for r in self.rows:
            tol = f"{r.atol:>9.0e}" if r.atol is not None else f"{'':>9}"
            lines.append(f"{r.name:<{w}}{str(tuple(r.shape)):<16}{r.max_abs:>11.3e}{tol}  {r.status}"
                         + (f"  {r.note}" if r.note else ""))
        return "\n".join(lines + [self.verdict])

    def as_dict(self) -> dict:
        return {"kind": self.kind, "subject": self.subject, "passed": self.passed, "info": self.info,
                "rows": [r.as_dict() for r in self.rows], "verdict": self.verdict,
                "diagnosis": self.diagnosis.as_dict() if self.diagnosis else None,
                "diagnoses": [d.as_dict() for d in self.diagnoses]}


# ---- the FFN's two linear layers -----------------------------------------------------------------------

def pointwise_conv(m: nn.Module) -> bool:
    """An nn.Conv1d of kernel size 1 (weight [out, in, 1]): a linear layer over channels, as the Transformer paper
    describes the FFN ("two convolutions with kernel size 1")."""
    return (isinstance(m, nn.Conv1d) and m.kernel_size == (1,) and m.stride == (1,) and m.dilation == (1,)
            and m.groups == 1 and m.padding in ((0,), "valid", "same"))  # "same" pads 0 at kernel size 1


def is_linear(m: nn.Module) -> bool:
    """A module holding a 2-D `weight` (nn.Linear, Conv1D-style), or a pointwise nn.Conv1d."""
    return isinstance(m._parameters.get("weight"), torch.Tensor) and (m._parameters["weight"].dim() == 2
                                                                      or pointwise_conv(m))


def linear_layers(module: nn.Module) -> list:
    """(name, submodule) of every linear submodule (is_linear), in order."""
    return [(n, m) for n, m in module.named_modules() if m is not module and is_linear(m)]


def layout(m: nn.Module, d: int, side: str) -> tuple:
    """(layout, n_in, n_out) of a linear layer whose `side` ('in' for c_fc, 'out' for c_proj) is n_embd=d.

    nn.Linear stores [out, in]; any other module is told apart by which side of its weight is d."""
    a, b = m._parameters["weight"].shape[:2]
    if isinstance(m, nn.Linear) or pointwise_conv(m):
        return "[out, in]", b, a
    if (a if side == "in" else b) == d:
        return "[in, out]", a, b
    if (b if side == "in" else a) == d:
        return "[out, in]", b, a
    return None, a, b


def _width(n: int) -> str:
    if n in GPT2_WIDTHS:
        return ""
    if n < 1:
        return f"; a width of {n} is no model's: look at what it was built with (--config)"
    tiny = " or --preset tiny (n_embd 64; check(obj, preset='tiny') in Python)" if n == 64 else ""
    return (f"; {n} fits no GPT-2 width ({', '.join(map(str, GPT2_WIDTHS))}): judge it against a checkpoint of "
            f"width {n}, --model DIR (check(obj, model=DIR)){tiny}")


def _load(m: nn.Module, w, b, lay: str, name: str) -> str:
    """Copy HF-layout weight w [in, out] (transposed for [out, in]) and bias b into m; '' or a note."""
    with torch.no_grad():
        weight = m._parameters["weight"]  # [out, in, 1] for a pointwise nn.Conv1d
        weight.copy_(torch.from_numpy(np.ascontiguousarray(w if lay == "[in, out]" else w.T)).view(weight.shape))
        bias = m._parameters.get("bias")
        if bias is None:
            return "no bias"
        if tuple(bias.shape) != b.shape:
            raise CheckError(f"{name}.bias has shape {tuple(bias.shape)}; its layer needs {b.shape}")
        bias.copy_(torch.from_numpy(b))
    return ""


# ---- the reference ------------------------------------------------------------------------------------

@lru_cache(maxsize=4)
def random_case(source: str, layer: int) -> FFNCase:
    """Block `layer`'s FFN of a seeded random HF GPT-2 or of a checkpoint directory, computed here (offline), on
    seed 001's prompt ids."""
    from .golden import capture, load_reference
    model, cfg, info = load_reference(source)
    if not 0 <= layer < cfg.n_layer:
        raise CheckError(f"layer={layer} (--layer) is out of range: {source} has layers 0..{cfg.n_layer - 1}")
    ids = [i % cfg.vocab_size for i in TOKEN_IDS]
    t = capture(model, cfg, ids, [layer])
    return FFNCase(source=info["source"], layer=layer, approximate=cfg.gelu_approximate,
                   weights={k: v.float().numpy() for k, v in model.transformer.h[layer].mlp.state_dict().items()},
                   x=t[f"h{layer}_ln_2"], resid=t[f"h{layer}_attn_resid"],
                   expected={s: t[f"h{layer}_{s}"] for s in STAGES})


def reference(golden=None) -> tuple:
    """(Config, a function of layer giving the FFNCase) for a golden directory or a random: preset."""
    source = str(golden) if golden is not None else DEFAULT_REFERENCE
    if source.startswith("random:"):
        from .model import parse_random
        return parse_random(source)[0], lambda layer: random_case(source, layer)
    from .golden import Golden
    g = Golden(source)
    return g.config, g.ffn_case


# ---- the checks ---------------------------------------------------------------------------------------

def check(obj, golden=None, layer: int = 0, config=None, name: str | None = None, model=None,
          preset: str | None = None):
    """Check a learner's FFN, GELU or whole GPT-2: an nn.Module class (built with its file's config class or
    one config dict), an instance, or a GELU function. golden: a directory from `gpt2ffn extract`, or
    random:<preset>[:seed] (default random:gpt2:0, offline); layer: the FFN's block; config: what a class is
    built with (--config: a dict, preset name or JSON); model: a whole model's reference weights (a checkpoint
    directory or random:<preset>[:seed]; default: golden's model). A module holding an nn.Embedding is a whole
    model and gets gpt2ffn.check_model's checkpoint-by-checkpoint report. An instance is judged with the
    reference's weights loaded into it and is given back as it came (its own weights, dtypes and mode).
    preset: the same as model=f"random:{preset}:0" (the CLI's --preset: "tiny" for n_embd 64)."""
    if isinstance(obj, str):  # the CLI's FILE.py:NAME
        obj, label = load_object(obj)
        name = name or label
    name = name or getattr(obj, "__name__", type(obj).__name__)
    if inspect.isfunction(obj) and not _params(obj):  # def make(): return nn.Sequential(...), or a script's main()
        raise CheckError(f"{name} takes no arguments, so it is neither a GELU (f(x)) nor an FFN function; if it "
                         f"makes the module, check what it makes: in the file `ffn = {obj.__name__}()` and check "
                         f"FILE.py:ffn, or check({obj.__name__}()) in Python")
    if preset is not None:
        if model is not None:
            raise CheckError(f"give model or preset, not both (preset={preset!r} is model='random:{preset}:0')")
        model = f"random:{preset}:0"
    if golden is not None and model is not None and not same_weights(model_source(golden), str(model)):
        raise CheckError(f"give golden or model (--preset), not both: golden {str(golden)!r} is judged with the "
                         f"weights it was taken from, model {str(model)!r} with its own")
    if isinstance(obj, (torch.jit.ScriptModule, torch.jit.ScriptFunction)):
        raise CheckError(f"{name} is TorchScript (torch.jit.script or trace), whose layers check cannot load or "
                         f"hook: check the nn.Module (or function) before scripting it")
    source = model_source(golden, model)
    if model is not None and not str(model).startswith("random:"):  # a checkpoint: its FFNs computed here
        ref_cfg, case_of = Config.from_pretrained(model), lambda layer: random_case(source, layer)
    else:
        ref_cfg, case_of = reference(golden if model is None else source)
    if inspect.isclass(obj) and not issubclass(obj, nn.Module) and (fn := plain_class(obj)) is not None:
        return check_function(fn, name, case_of(layer))
    if inspect.isclass(obj):
        if not issubclass(obj, nn.Module):
            raise CheckError(f"{name} is a class but not an nn.Module, nor a plain FFN class built from its weights "
                             f"(__init__(self, w1, b1, w2, b2) or (self, c_fc, c_proj), then forward(x) or "
                             f"__call__(x)); check takes an FFN, GELU or GPT-2 module")
        module, how = build(obj, ref_cfg, config)
        if how.endswith("(GPT_CONFIG_124M)") and is_model(module):  # the book's dict turns off c_attn's bias
            module, how = build(obj, ref_cfg, config, qkv_bias=True)
        built = [f"built as {how}"]
    elif isinstance(obj, nn.Module):
        built = [f"a function of x over {', '.join(obj.held)} (the modules it closes over), judged as a module holding "
                 f"them" if isinstance(obj, Closure) else f"an instance of {type(obj).__name__}"]
        meta = next((n for n, t in [*obj.named_parameters(), *obj.named_buffers()] if t.is_meta), None)
        if meta is not None:
            raise CheckError(f"{name}'s {meta} is on the meta device (a shape with no values): build it on the CPU "
                             f"(check loads GPT-2's weights into it), or give check the class")
        packed = packed_precisions(obj)
        if packed:  # gpt2ffn's own layers, whose packed weights may be their only copy: judged on a plain copy
            built.append(f"its layers compute with gpt2ffn's packed {' and '.join(packed)} weights: judged on a copy "
                         f"unpacked to fp32 Parameters (GPT-2's math, at 1e-4; the packed kernels are checked by "
                         f"`gpt2ffn verify` and the tests); the module itself is left as it is")
            return _check_built(unpacked_copy(obj), name, built, source, case_of, ref_cfg, layer)
        with kept(obj):  # the caller's own module: its weights, dtypes and buffers come back as they were
            return _check_built(obj, name, built, source, case_of, ref_cfg, layer)
    elif callable(obj) and (held := closure_modules(obj)):  # minGPT's mlpf: a lambda over its mlp ModuleDict
        return check(Closure(obj, held), golden=golden, layer=layer, config=config, name=name, model=model)
    elif callable(obj):
        names = weight_params(obj)
        if is_model_function(names):
            return check_picogpt(obj, name, names, source, case_of, ref_cfg)
        if len(names) > 0:
            return check_function(obj, name, case_of(layer))
        return check_gelu(obj, name, ref_cfg.gelu_approximate, ["a function"])
    else:
        kind = type(obj).__name__
        article = "an" if kind[0].lower() in "aeiou" else "a"
        raise CheckError(f"{name if name != kind else repr(obj)[:40]} is {article} {kind}; check takes an nn.Module "
                         "class or instance, a GELU or FFN function, or 'FILE.py:NAME'")
    return _check_built(module, name, built, source, case_of, ref_cfg, layer, fresh=True)


def same_weights(a: str, b: str) -> bool:
    """Whether two model sources name the same weights: random:<preset>[:seed] as its canonical name, a directory
    as its resolved path."""
    def canonical(x):
        return parse_random(x)[2] if x.startswith("random:") else str(Path(x).resolve())
    try:
        return canonical(a) == canonical(b)
    except Gpt2ffnError:
        return a == b


class Closure(nn.Module):
    """A function of x alone that runs modules it closes over (minGPT's `self.mlpf = lambda x:
    m.dropout(m.c_proj(m.act(m.c_fc(x))))`, m its mlp ModuleDict), as a module holding them, so check judges it as
    an FFN: its layers loaded, hooked and run in eval()."""

    def __init__(self, fn, held: dict):
        super().__init__()
        self.fn, self.held = fn, nn.ModuleDict(held)

    def forward(self, x):
        return self.fn(x)

    def __deepcopy__(self, memo):
        """A copy whose function runs the copied modules (copy.deepcopy hands a function back as it is, still
        closing over the originals): its closure cells are rebuilt over the copies."""
        held = copy.deepcopy(self.held, memo)
        swap = {id(self.held[k]): held[k] for k in self.held}
        cells = tuple(types.CellType(swap.get(id(c.cell_contents), c.cell_contents)) for c in self.fn.__closure__)
        fn = types.FunctionType(self.fn.__code__, self.fn.__globals__, self.fn.__name__, self.fn.__defaults__, cells)
        return Closure(fn, dict(held.items()))


def closure_modules(fn) -> dict:
    """The nn.Modules that a one-argument function closes over (its free variables), by name, where they hold two
    linear layers or more between them (an FFN's; a GELU reading a module's flag closes over fewer); {} for any
    other callable."""
    if not inspect.isfunction(fn) or len(weight_params(fn)) > 0:
        return {}
    try:
        free = inspect.getclosurevars(fn).nonlocals
    except (TypeError, ValueError):
        return {}
    held = {k: v for k, v in free.items() if isinstance(v, nn.Module)}
    # (m itself counted: a closure straight over an nn.Linear holds one)
    return held if sum(len(linear_layers(v)) + is_linear(v) for v in held.values()) >= 2 else {}


@contextlib.contextmanager
def kept(module: nn.Module):
    """Give the module back as it came: check loads the reference's weights into its layers (and runs a
    half-precision one in float32), so every parameter and buffer is saved first and put back after, in place
    (the same tensors and storage: tied weights stay tied, views of them stay valid), with their gradients and
    every submodule's train/eval mode. The copies take as much memory as the module, on its device."""
    saved = [(m._parameters, k, t, t.data, t.detach().clone())
             for m in module.modules() for k, t in m._parameters.items() if t is not None]
    saved += [(m._buffers, k, t, t, t.detach().clone())
              for m in module.modules() for k, t in m._buffers.items() if t is not None]
    grads = [(t, t.grad, t.grad.data) for _, _, t, data, _ in saved if t is not data and t.grad is not None]
    modes = [(m, m.training) for m in module.modules()]  # each submodule's own (a Dropout left in eval())
    try:
        yield
    finally:
        with torch.no_grad():
            for owner, k, t, data, value in saved:
                owner[k] = t
                if t is not data:  # a Parameter: .float() gave it new data, its own storage is `data`
                    t.data = data
                data.copy_(value)
            for t, grad, data in grads:  # .float() converts a gradient too
                grad.data = data
                t.grad = grad
        for m, training in modes:
            m.training = training


def _check_built(module: nn.Module, name: str, built: list, source: str, case_of, ref_cfg: Config, layer: int,
                 fresh: bool = False):
    """check() of a module: a half-precision one judged in float32. fresh: check built it (from a class), so its
    weights are its init's, not a loader's."""
    halves = sorted({str(p.dtype).removeprefix("torch.") for p in module.parameters()
                     if p.is_floating_point() and p.dtype != torch.float32})
    if halves:  # GPT-2's math is what is judged, at the fp32 bar: in bf16 itself every stage is ~1e-2 off
        module = module.float()
        low = [h for h in halves if h != "float64"]
        built.append(f"its parameters are {' and '.join(halves)}: judged in float32 (module.float()), as GPT-2's "
                     + (f"math is checked at 1e-4; in {low[0]} itself every stage differs by ~1e-2" if low else
                        "weights and HF's stages are"))
        try:
            return _check_module(module, name, built, source, case_of, ref_cfg, layer, fresh)
        except CheckError as e:
            if "dtype" not in str(e).lower():
                raise
            raise CheckError(f"{e} (check ran {name} in float32 with module.float(), its parameters being {halves[0]}: "
                             f"a forward that casts its input to {halves[0]} itself cannot run so; cast it to the "
                             f"weights' dtype instead, x.to(next(self.parameters()).dtype))") from None
    return _check_module(module, name, built, source, case_of, ref_cfg, layer, fresh)


def _check_module(module: nn.Module, name: str, built: list, source: str, case_of, ref_cfg: Config,
                  layer: int, fresh: bool = False):
    """check() of a module (its parameters in float32): a whole model, an FFN or a GELU."""
    if is_model(module):
        return probe_ffn(check_model(module, name, built, source, fresh=fresh), module, name, source)
    linears = linear_layers(module)
    part = "GPT-2's FFN, its GELU or the whole model (the module holding the embeddings)"
    if isinstance(module, (nn.ModuleDict, nn.ModuleList)) and type(module).forward is nn.Module.forward:
        raise CheckError(f"{name} is an nn.{type(module).__name__}, which has no forward of its own: check the "
                         f"module that runs it (minGPT's Block runs its mlp ModuleDict in a lambda: check the "
                         f"whole GPT), or wrap it in an nn.Module whose forward is the FFN")
    if not linears and getattr(module, "weight", None) is not None and module.weight.dim() == 2:
        raise CheckError(f"{name} is one linear layer ({tuple(module.weight.shape)}); check judges {part}")
    linears = linears or raw_linears(module, ref_cfg.n_embd)
    if not linears:
        convs = [n for n, m in module.named_modules() if isinstance(m, nn.modules.conv._ConvNd)]
        if convs:  # wider kernels, strides or groups: not a linear layer per token
            raise CheckError(f"{name} holds convolutions ({', '.join(convs)}) that are not pointwise (nn.Conv1d of "
                             f"kernel size 1): GPT-2's FFN is two linear layers applied to each token alone; check "
                             f"judges {part}")
        if any(p.dim() == 1 for p in module.parameters()) or isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            raise CheckError(f"{name} holds parameters but no linear layer: a LayerNorm? check judges {part}, "
                             "which checks every LayerNorm it holds")
        return check_gelu(module, name, ref_cfg.gelu_approximate, built)
    c_attn = sorted((ref_cfg.n_embd, 3 * ref_cfg.n_embd))
    # c_attn's shape in both layers is an FFN of hidden width 3 * n_embd (a hard-coded 3072 at n_embd 1024)
    attention = sum(sorted(m.weight.shape) == c_attn for _, m in linears) == 1
    if len(linears) == 1 and layout(linears[0][1], ref_cfg.n_embd, "in")[1:] == (ref_cfg.n_embd, ref_cfg.hidden):
        return check_no_proj(module, linears[0], name, built, case_of(layer))
    if len(linears) == 3 and not attention:  # gate and up (d -> h, the same shape) then down (h -> d): SwiGLU
        shapes = [tuple(sorted(m.weight.shape)) for _, m in linears]
        d = ref_cfg.n_embd
        if len(set(shapes)) == 1 and d in shapes[0] and shapes[0] != (d, d):
            raise CheckError(f"{name} has 3 linear layers of one shape ({', '.join(n for n, _ in linears)}): a gated "
                             f"FFN (SwiGLU or GEGLU, as LLaMA's: act(gate(x)) * up(x), then down)? GPT-2's FFN has "
                             f"no gate: c_fc -> GELU (tanh) -> c_proj, two linear layers with biases")
    if len(linears) != 2:
        more = f": attention or a whole block? check judges {part}" if len(linears) > 2 or attention else ""
        convs = [f"{n} is an nn.Conv1d of kernel size {m.kernel_size[0]}" for n, m in module.named_modules()
                 if isinstance(m, nn.modules.conv._ConvNd) and not pointwise_conv(m)]
        if convs:
            more += f" ({'; '.join(convs)}: GPT-2's FFN is applied to each token alone)"
        layers = f"{len(linears)} linear layer{'s' if len(linears) != 1 else ''}"
        raise CheckError(f"{name} has {layers} ({', '.join(n for n, _ in linears)}); "
                         f"an FFN has two, c_fc then c_proj{more}")
    if attention:
        raise CheckError(f"{name} has a layer of shape {ref_cfg.n_embd} x {3 * ref_cfg.n_embd} (c_attn: q, k and v): "
                         f"it is attention, not an FFN; check judges {part}")
    return check_ffn(module, in_order(module, linears, ref_cfg.n_embd), name, built, case_of(layer))


def probe_ffn(report: ModelReport, module: nn.Module, name: str, source: str) -> ModelReport:
    """A whole model's pass, where its FFNs' inputs may be too small to tell a known FFN mistake from the right
    FFN (a checkpoint saved from HF's random init: c_fc's outputs within |x| ~ 0.5, where the exact GELU is
    within 1e-4 of the tanh one): block 0's FFN module is judged again alone, as check judges an FFN (check_ffn:
    on the same tokens scaled where the prompt cannot tell), and a mistake it shows fails the model at
    checkpoint 06. Where the FFN is not a module of its own (inline in the block), the report says that the
    prompt could not tell those mistakes and the FFN was not probed."""
    if not report.passed:
        return report
    ref = model_reference(source)
    block, case = find_structure(module, ref.cfg).blocks[0], ffn_case(ref, 0)
    def unprobed(why: str) -> ModelReport:
        blind = blind_to(case, GOLDEN_ATOL)
        if not blind:
            return report
        report.info.append(f"note: on this prompt {len(blind)} known FFN mistake{'s' * (len(blind) > 1)} also "
                           f"pass within {GOLDEN_ATOL:.0e} ({'; '.join(blind)}), and {why}: check the FFN by "
                           f"itself, or the model against random:<preset> (--preset)")
        but = "and" if "; but " in report.verdict else "but"
        return dataclasses.replace(report, verdict=report.verdict + f"; {but} on this prompt {len(blind)} known FFN "
                                   f"mistake{'s' * (len(blind) > 1)} would pass too (the note above)")
    if not all(k in block for k in ("mlp", "mlp.c_fc", "mlp.c_proj")) or not runs_alone(block):
        return unprobed("its FFN is not a module of its own that check could run alone on a wider input")
    mlp, fc, proj = block["mlp"], block["mlp.c_fc"], block["mlp.c_proj"]
    try:
        r = check_ffn(mlp.module, [(fc.name, fc.module), (proj.name, proj.module)], f"{name}'s {mlp.name}", [], case,
                      shapes=False)  # a batch and more tokens: the model's own rows judge those
    except CheckError as e:
        return unprobed(f"its FFN module {mlp.name} could not be run alone ({e})")
    scaled = [row for row in r.rows if row.name.endswith(", scaled")]
    if not scaled:  # the prompt tells the known FFN mistakes apart (the model passed on it), or the module alone
        return report if r.passed else unprobed(  # is not GPT-2's FFN on ln_2's output (a LayerNorm inside it)
            f"its FFN module {mlp.name} alone on ln_2's output is not GPT-2's FFN ({r.verdict})")
    info = report.info + [f"block 0's FFN ({mlp.name}) judged alone too: {r.info[-1]}"]
    worst = max(scaled, key=lambda row: (row.status == "FAIL", row.max_abs if row.max_abs == row.max_abs else -1.0))
    rows = list(report.rows)
    at = next(i for i, row in enumerate(rows) if row.checkpoint == "07")  # after checkpoint 06's rows
    rows.insert(at, ModelRow("06", f"FFN alone, input scaled ({worst.name.removesuffix(', scaled')})", "0",
                             worst.shape, worst.max_abs, worst.atol, "FAIL" if not r.passed else "PASS", worst.note))
    if r.passed:
        return dataclasses.replace(report, info=info, rows=rows,
                                   verdict=report.verdict + "; block 0's FFN also passes alone on its input scaled")
    what = r.verdict.split(": ", 1)[1] if ": " in r.verdict else r.verdict
    verdict = (f"FAIL (block 0's FFN alone, its input scaled, checkpoint 06): {what}; on this prompt every stage "
               f"passed, as the FFN's inputs were too small to tell")
    return ModelReport(report.subject, info, rows, verdict, r.diagnosis,
                       {"layer": 0, "stage": r.diagnosis.stage if r.diagnosis else "ffn", "checkpoint": "06",
                        "what": "the FFN alone, its input scaled"})


def raw_linears(module: nn.Module, d: int) -> list:
    """A module holding an FFN's weights as its own Parameters, two matrices and their biases (seed 001's FFN
    struct: c_fc_weight [d, 4d], c_fc_bias, c_proj_weight, c_proj_bias): (name, a stand-in module holding the
    same Parameters) per layer, for check_ffn to load and judge; [] for any other module."""
    own = list(module.named_parameters(recurse=False))
    mats = [(n, p) for n, p in own if p.dim() == 2]
    holders = [c for c in module.children() if any(True for _ in c.parameters())]  # an activation module holds none
    if len(mats) != 2 or any(p.dim() > 2 for _, p in own) or holders:
        return []
    return [(n, OwnLinear(w, b)) for n, w, b in own_linears(own, d)]  # loading them loads the learner's


def in_order(module: nn.Module, linears: list, d: int) -> list:
    """The two linear layers in the order they run, c_fc first: a module may define c_proj first. Seen by one
    forward on zeros with the module's own weights (fed as _run feeds it); where it does not run them both (or
    fails), by name, or by
    nn.Linear layers whose first does not take n_embd while the second does."""
    (n1, l1), (n2, l2) = linears
    calls = []
    hooks = [m.register_forward_pre_hook(lambda m, a, i=i: calls.append(i)) for i, (_, m) in enumerate(linears)]
    was_training = module.training
    try:
        param = next(module.parameters())
        for shape in ((1, 1, d), (1, d), (d,)):  # as _run feeds it: (1, T, d), else (T, d), else a token's vector
            calls.clear()
            try:
                with torch.no_grad():
                    module.eval()(torch.zeros(shape, dtype=param.dtype, device=param.device))
                break
            except Exception:
                calls.clear()
    finally:
        for h in hooks:
            h.remove()
        module.train(was_training)
    if sorted(calls[:2]) == [0, 1]:
        return linears if calls[0] == 0 else linears[::-1]
    fc, proj = (re.compile(LINEAR_HINTS[k], re.I) for k in ("mlp.c_fc", "mlp.c_proj"))  # c_fc, up, fc1, w1, ...
    named = bool(proj.search(n1) and fc.search(n2) and not (fc.search(n1) or proj.search(n2)))
    shaped = isinstance(l1, nn.Linear) and isinstance(l2, nn.Linear) and l1.in_features != d == l2.in_features
    return linears[::-1] if named or shaped else linears


def check_ffn(module: nn.Module, linears: list, name: str, built: list, case: FFNCase,
              atol: float = GOLDEN_ATOL, shapes: bool = True) -> Report:
    """Load the case's weights into the two linear layers, run in eval(), judge and diagnose each stage.
    A layer of a square weight (n_inner == n_embd) not of nn.Linear is run in both layouts (the shape cannot tell
    them apart): the first that passes is the report; where none does, the one naming a mistake other than the
    layout's (transposing was tried), else the nearest (layout_choice). The module is left holding the weights
    of the last layout run (check gives an instance back as it came, kept())."""
    l1, l2 = (m for _, m in linears)
    flips = [(False, False)] + [(f1, f2) for f1 in (False, True) for f2 in (False, True)
                                if (f1 or f2) and (square(l1) or not f1) and (square(l2) or not f2)]
    reports = []
    for flip in flips:
        report = _check_ffn(module, linears, name, list(built), case, atol, flip, shapes)
        if report.passed:
            return report
        reports.append(report)
    if len(reports) == 1:
        return reports[0]
    squares = [n for n, m in linears if square(m)]
    what = " and ".join(squares) + (" are" if len(squares) > 1 else " is")
    return layout_choice(reports, what, every_layer=len(squares) == 2)


def layout_choice(reports: list, what: str, every_layer: bool) -> Report:
    """Of failing reports, one per layout of square weights (`what`: which are square): the one that names a
    mistake other than a layout's (a transposed weight: transposing was tried), else the one whose output is
    nearest; with a note saying so (that the layout is not the mistake only where it named another mistake and
    every layer's layout was tried)."""
    def named(r):
        key = r.diagnosis.key if r.diagnosis else None
        return key is not None and not key.endswith(("not_transposed", "viewed"))
    report = min(reports, key=lambda r: (not named(r), r.rows[-1].max_abs))
    report.info.append(f"note: {what} square (n_inner == n_embd), and a square weight's shape cannot tell [in, out] "
                       f"from [out, in]: check ran it in each layout and none matched" +
                       (", so the layout is not the mistake" if named(report) and every_layer else ""))
    return report


def _check_ffn(module: nn.Module, linears: list, name: str, built: list, case: FFNCase, atol: float,
               flip: tuple, shapes: bool = True) -> Report:
    """check_ffn in one layout: each layer's as its shape says, or (flip) the other one of a square weight;
    shapes: a pass judged on more tokens and a batch too (shaped)."""
    other = {"[in, out]": "[out, in]", "[out, in]": "[in, out]"}
    (n1, l1), (n2, l2) = linears
    d, hidden = case.weights["c_fc.weight"].shape
    lay1, i1, o1 = layout(l1, d, "in")
    lay1 = other[lay1] if flip[0] and lay1 else lay1
    if lay1 is None or i1 != d:
        shape = tuple(l1._parameters["weight"].shape)
        maps = f"maps {i1} -> {o1}" if lay1 else f"has weight {shape}, neither side n_embd={d}"
        raise CheckError(f"{name}'s first linear layer {n1} {maps}; GPT-2 here ({case.source}) has n_embd={d}, "
                         f"c_fc maps {d} -> {hidden}{_width(i1) if lay1 else ''}")
    lay2, i2, o2 = layout(l2, d, "out")
    lay2 = other[lay2] if flip[1] and lay2 else lay2
    if lay2 is None or (i2, o2) != (o1, d):
        raise CheckError(f"{name}'s second linear layer {n2} has weight {tuple(l2._parameters['weight'].shape)}; "
                         f"after {n1} ({d} -> {o1}) c_proj maps {o1} -> {d}")
    if hidden // 2 != o1 < hidden:  # named as a variant of its own width
        case = dataclasses.replace(case, width=o1, _known=None)
    if o1 > hidden:
        fix = ("use nn.Linear(emb_dim, 4 * emb_dim)" if hidden == 4 * d else
               f"this reference's FFN is n_inner = {hidden} wide (not 4 x n_embd): build c_fc as "
               f"nn.Linear(n_embd, n_inner) from the checkpoint's config")
        raise CheckError(f"{name}'s hidden width is {o1} ({o1 / d:.4g}x n_embd), wider than the reference's {hidden} "
                         f"({hidden / d:.4g}x): no GPT-2 weights fit it; {fix}")

    def load(w: dict) -> list:
        return [_load(l1, w["c_fc.weight"][:, :o1], w["c_fc.bias"][:o1], lay1, n1),
                _load(l2, w["c_proj.weight"][:o1], w["c_proj.bias"], lay2, n2)]
    notes = load(case.weights)
    info = built + [f"c_fc = {n1} ({type(l1).__name__}, {lay1}), c_proj = {n2} ({type(l2).__name__}, {lay2})"
                    + "".join(f"; {n} has {note}" for n, note in zip((n1, n2), notes) if note)]
    if o1 < hidden:
        info.append(f"hidden width {o1} ({o1 / d:g}x n_embd), GPT-2's is {hidden} ({hidden / d:g}x): "
                    f"loaded the first {o1} of c_fc's units")
    T = case.x.shape[1]
    info.append(f"fed {case.source} layer {case.layer}'s ln_2 output (1, {T}, {d}) in eval(); "
                f"compared with HF GPT-2's own stages, tolerance {atol:.0e}")
    param = next(module.parameters())
    x = torch.from_numpy(case.x).to(param.dtype)
    unseen = "not hooked: the module uses the layer's weights without calling it"
    was_training = module.training
    module.eval()
    try:
        first, again = _run(module, l1, l2, x, name, info), _run(module, l1, l2, x, name)
        report = _judge(name, info, first, again, case, atol, unseen)

        def run(probe: FFNCase) -> list:
            load(probe.weights)
            try:
                return [_run(module, l1, l2, torch.from_numpy(probe.x).to(param.dtype), name) for _ in range(2)]
            finally:
                load(case.weights)  # the module is left holding the set's weights, as before the probe
        # where the activation is not seen (a module computing x @ W itself), the probe's c_proj passes it through
        report = _widen(report, case, atol, unseen, run, pass_through="gelu" not in first)
        if not shapes:  # inside a whole-model check: its own rows judge the rest
            return report
        report = activation_alone(report, module, case)

        def output(xs):
            with torch.no_grad():
                out = module(torch.from_numpy(xs.copy()).to(param.dtype))
            out = out[0] if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) else out
            return out.float().numpy()
        return shaped(report, case, atol, output)
    finally:
        module.train(was_training)


def no_proj_report(name: str, info: list, rows: list, shape: tuple, d: int) -> Report:
    """The FAIL of an FFN that stops after the activation: its output (shape) is c_fc's width, not n_embd."""
    width = shape[-1]
    text = (f"c_proj missing: {name} returns {width} values a token (c_fc's width); GPT-2's FFN projects them back "
            f"to n_embd = {d} with c_proj, a second linear layer ({width} -> {d}, with bias) after the activation")
    rows = rows + [Row(STAGE_LABELS["ffn"], tuple(shape), float("nan"), None, "FAIL",
                       f"shape (..., {width}); GPT-2's FFN returns (..., {d})")]
    return Report("ffn", name, info, rows, f"FAIL (output): {text}", Diagnosis("ffn", "c_proj_missing", text),
                  [Diagnosis("ffn", "c_proj_missing", text)])


def check_no_proj(module: nn.Module, linear: tuple, name: str, built: list, case: FFNCase,
                  atol: float = GOLDEN_ATOL) -> Report:
    """A module with one linear layer, c_fc's shape: c_fc loaded and judged, the missing c_proj named."""
    n1, l1 = linear
    d, hidden = case.weights["c_fc.weight"].shape
    lay1 = layout(l1, d, "in")[0]
    note = _load(l1, case.weights["c_fc.weight"], case.weights["c_fc.bias"], lay1, n1)
    info = built + [f"c_fc = {n1} ({type(l1).__name__}, {lay1}){'; it has ' + note if note else ''}; no second "
                    f"linear layer", f"fed {case.source} layer {case.layer}'s ln_2 output in eval()"]
    was_training = module.training
    module.eval()
    try:
        seen = _run(module, l1, None, torch.from_numpy(case.x).to(next(module.parameters()).dtype), name)
    finally:
        module.train(was_training)
    rows = []
    if "c_fc" in seen:
        from .golden import compare
        r = compare(STAGE_LABELS["c_fc"], {"checkpoint": "06", "layer": case.layer}, seen["c_fc"],
                    case.expected["c_fc"], atol)
        rows.append(Row(STAGE_LABELS["c_fc"], tuple(seen["c_fc"].shape), r.max_abs, atol, r.status, r.note))
    shape = seen["ffn"].shape
    if shape[-1:] != (hidden,):
        raise CheckError(f"{name} has one linear layer ({n1}, {d} -> {hidden}) and returns shape {shape}; an FFN "
                         f"has two, c_fc then c_proj")
    return no_proj_report(name, info, rows, shape, d)


PROBE_REACH = 4.0  # |c_fc output| a widened check reaches: past 2.70, where exact and tanh GELU differ most


def _blind_at(case_of, layer: int) -> list:
    """blind_to of block `layer`'s case; [] where the reference has no such case (a golden set without it)."""
    try:
        return blind_to(case_of(layer), GOLDEN_ATOL)
    except Gpt2ffnError:
        return []


def activation_alone(report: Report, module: nn.Module, case: FFNCase) -> Report:
    """A pass whose FFN holds its activation as a module of its own (nanoGPT's NewGELU), that module judged alone
    as a GELU (check_gelu: -10..10 and |x| to 400): the FFN's inputs reach a few units, and a GELU written with
    exp gives NaN past |x| ~ 10 (passed inside the FFN, failed alone)."""
    acts = [(n, m) for n, m in module.named_modules() if n and not any(True for _ in m.parameters())
            and not isinstance(m, (nn.Dropout, nn.Identity)) and not list(m.children())]
    if not report.passed or len(acts) != 1:
        return report
    name, act = acts[0]
    try:
        alone = check_gelu(act, f"{report.subject}'s {name}", case.approximate, [])
    except CheckError:  # not a GELU of x alone (a module of its own kind): the FFN's own rows judged it
        return report
    if alone.passed:
        return report
    row = Row(f"{name} alone (GELU grid)", (len(GELU_GRID),), alone.rows[-1].max_abs, None, "FAIL", alone.verdict)
    verdict = (f"FAIL ({name} alone): right on this FFN's inputs, but as a GELU over -10..10 and |x| to 400 "
               + alone.verdict.removeprefix("FAIL: "))
    return Report(report.kind, report.subject, report.info, report.rows + [row], verdict, report.diagnosis,
                  report.diagnoses)


def shaped(report: Report, case: FFNCase, atol: float, run) -> Report:
    """A pass on the prompt checked on more tokens, and on a batch: the prompt then its tokens reversed and scaled
    by 1.5, 2T tokens (GELU's inputs past the prompt's reach), and as a second sequence those x 0.7, against the
    right FFN of them (float64, at the bar the residual stream has: the larger of atol and 1e-5 x its max |value|,
    float32's own rounding of large outputs). An FFN applies to each token alone: one right only on the first
    tokens, on one sequence, or below a clamp the prompt does not reach passed. run(x): its output for x; fed
    (2, 2T, d), else (1, 2T, d), else (2T, d), the first it takes (one it takes a token at a time: not judged,
    said). A (B * T, d) output is read as (B, T, d)."""
    if not report.passed or case.width is not None:
        return report
    x = np.asarray(case.x, np.float32)
    long = np.concatenate([x, 1.5 * x[:, ::-1]], axis=1)
    first = None
    for fed in (np.concatenate([long, 0.7 * long[:, ::-1]]), long, long[0]):
        try:
            got = np.asarray(run(fed), np.float64)
            break
        except Exception as e:
            first = first or e
    else:
        report.info.append(f"note: not judged on more tokens or a batch: it fails on (2, {long.shape[1]}, "
                           f"{x.shape[2]}), {long.shape} and {long[0].shape} "
                           + f"({type(first).__name__}: {first})".splitlines()[0])
        return report
    want = case.given(fed).expected["ffn"]
    got = got.reshape(want.shape) if got.size == want.size else got
    batch = fed.ndim == 3 and fed.shape[0] == 2
    label = f"output, {'2 sequences x ' if batch else ''}{long.shape[1]} tokens"
    tol = max(atol, GOLDEN_SCALED["block"] * float(np.abs(want).max()))
    if got.shape != want.shape:
        row = Row(label, got.shape, float("nan"), tol, "FAIL", f"shape {got.shape}, expected {want.shape}")
    else:
        err = np.abs(got - want)
        worst = float(err.max()) if np.isfinite(got).all() else float("nan")
        where = np.unravel_index(int(np.argmax(np.nan_to_num(err, nan=np.inf))), err.shape)
        ok = worst <= tol
        row = Row(label, got.shape, worst, tol, "PASS" if ok else "FAIL",
                  "" if ok else f"{worst:.3g} off at {list(map(int, where))}" if worst == worst else
                  f"NaN/Inf at {list(map(int, where))}")
    rows = report.rows + [row]
    if row.status == "PASS":
        return dataclasses.replace(report, rows=rows, verdict=report.verdict + f" (and on {long.shape[1]} tokens"
                                   + (", 2 sequences)" if batch else ")"))
    verdict = (f"FAIL ({label}): right on the prompt's {case.x.shape[1]} tokens, but {row.note} on {long.shape[1]} "
               "tokens" + (" in a batch of 2" if batch else "") + ": an FFN applies to each token alone, whatever "
               "the batch, the length or the values; a step that depends on the token's position, the sequence, or "
               "a cut-off of the values?")
    return Report(report.kind, report.subject, report.info, rows, verdict, report.diagnosis, report.diagnoses)


def _widen(report: Report, case: FFNCase, atol: float, unseen: str, run, pass_through: bool = False) -> Report:
    """A pass on inputs that cannot tell a known mistake from the right FFN (c_fc's outputs all small, as in a
    checkpoint saved from HF's random init: there the exact GELU is within 1e-4 of the tanh one) is checked again
    on the same tokens scaled until c_fc's outputs (less its bias) reach |x| = PROBE_REACH, against the right FFN
    of that input computed in float64 (FFNCase.given). Biases that are all 0 (HF's init) are drawn N(0, 0.1) for
    it, or a missing bias could not show. pass_through (a function, whose inner values are not seen): c_proj's
    weight passes the first n_embd hidden units through unchanged, so the output shows the activation itself.
    run(probe case): two runs' stages on its input (a module's layers loaded with the probe's weights)."""
    blind = blind_to(case, atol) if report.passed else []
    top = float(np.abs(np.asarray(case.x, np.float64) @ np.asarray(case.weights["c_fc.weight"], np.float64)).max())
    if not blind or not top > 0:
        return report
    scale = max(1.0, PROBE_REACH / top)  # (a set that reaches far already, but with zero biases: not shrunk)
    x = (np.asarray(case.x, np.float64) * scale).astype(np.float32)
    w, how = dict(case.weights), ["c_fc's weight"]
    rng = np.random.default_rng(0)
    for k in ("c_fc.bias", "c_proj.bias"):
        if not np.any(w[k]):
            w[k] = (0.1 * rng.standard_normal(w[k].shape)).astype(np.float32)
            how.append(f"{k} drawn N(0, 0.1) (the set's is 0)")
    if pass_through:
        hidden, d = w["c_proj.weight"].shape
        w["c_proj.weight"] = np.eye(hidden, d, dtype=np.float32)
        how.append("a c_proj weight that passes the first n_embd hidden units through")
    else:
        how.append("c_proj's weight")
    probe = FFNCase(case.source, case.layer, case.approximate, w, x, None, {}).given(x)
    first, again = run(probe)
    widened = _judge(report.subject, [], first, again, probe, atol, unseen)
    reach = float(np.abs(np.asarray(case.expected["c_fc"])).max())
    fed = (f"the same tokens x {scale:.3g} (c_fc's outputs to |x| ~ {PROBE_REACH:g})" if scale > 1 else
           "the same tokens")
    note = (f"on this set (c_fc's outputs reach |x| = {reach:.2g}) {len(blind)} known mistake"
            f"{'s' * (len(blind) > 1)} also pass within {atol:.0e} ({'; '.join(blind)}); so check also fed {fed} "
            f"and compared with the right FFN of them (float64; {', '.join(how)}): rows 'scaled'")
    rows = report.rows + [dataclasses.replace(r, name=f"{r.name}, scaled") for r in widened.rows]
    verdict = widened.verdict if not widened.passed else report.verdict + " (and with its input scaled)"
    return Report(report.kind, report.subject, report.info + [note], rows, verdict,
                  widened.diagnosis, widened.diagnoses)


def _judge(name: str, info: list, first: dict, again: dict, case: FFNCase, atol: float, unseen: str) -> Report:
    """The Report of an FFN's stages from two runs (`first`, `again`: stage -> output; a stage not in them is
    reported as `unseen`): each stage against HF's, the known mistakes the failing ones show, determinism."""
    from .golden import compare, number_hint
    rows, failing = [], []
    for stage in STAGES:
        label = STAGE_LABELS[stage]
        if stage not in first:
            rows.append(Row(label, (), float("nan"), None, "--", unseen))
            continue
        r = compare(label, {"checkpoint": "06", "layer": case.layer}, first[stage], case.expected[stage], atol)
        rows.append(Row(label, tuple(first[stage].shape), r.max_abs, atol, r.status, r.note))
        if r.status == "FAIL" and np.isfinite(first[stage]).all():
            failing.append(stage)
    deterministic = all(np.array_equal(first[k], again[k], equal_nan=True) for k in first if k in again)
    diagnoses = diagnose_stages(case, first, failing, atol)
    diagnosis = diagnoses[0] if diagnoses else None
    if not failing and all(r.status != "FAIL" for r in rows):
        verdict = f"PASS: {name} computes GPT-2's FFN (c_fc -> {FORMS[TARGET[case.approximate]][1]} -> c_proj)"
        if not deterministic:
            verdict = f"FAIL: {name} passes once but two runs differ: something random is on at inference"
            rows.append(Row("2 runs identical", (), 0.0, None, "FAIL", "two runs gave different outputs"))
    else:
        bad = next(r for r in rows if r.status == "FAIL")
        stage = next(k for k in STAGES if STAGE_LABELS[k] == bad.name)
        named_one = diagnosis is not None and diagnosis.key is not None
        encoded = None if named_one else number_hint(first[stage].astype(np.float32), case.expected[stage], atol)
        verdict = (f"FAIL ({bad.name}): {encoded.replace('write float32', 'return float32')}" if encoded else
                   f"FAIL ({STAGE_LABELS[diagnosis.stage]}): {diagnosis.text}" if len(diagnoses) == 1
                   else f"FAIL: {len(diagnoses)} known mistakes, most upstream first: " + "; ".join(
                       f"({i}) {STAGE_LABELS[d.stage]}: {d.text}" for i, d in enumerate(diagnoses, 1))
                   if diagnoses else f"FAIL ({bad.name}): {bad.note}")
        if not deterministic and (diagnosis is None or diagnosis.key != "dropout"):
            verdict += " (and two runs differ: something random is on at inference)"
    return Report("ffn", name, info, rows, verdict, diagnosis, diagnoses)


def diagnose_stages(case: FFNCase, outputs: dict, failing: list, atol: float) -> list:
    """Every known mistake the failing stages show, most upstream first. One known mistake that explains every
    failing stage is named alone (both biases missing matches all three stages; c_fc's bias alone only the first
    two). Otherwise each failing stage is judged on the module's own input to it (its own c_fc output, its own
    activation output), so independent mistakes (no biases and ReLU) are each named. Else dropout's signature,
    else the output's worst element. [] when nothing failed."""
    found = {}  # key -> [stages it matches, variant, first stage, distance there]
    for stage in failing:
        for dist, v in case.matching(stage, outputs[stage], atol):
            found.setdefault(v.key, [0, v, stage, dist])[0] += 1
    best = max(found.values(), key=lambda f: (f[0], -STAGES.index(f[2]), -f[3])) if found else None
    if best and best[0] == len(failing):
        return [named(best[1], best[2], best[3])]
    own = []
    for stage in failing:
        if stage == "c_fc":
            hits = [h for h in case.matching(stage, outputs[stage], atol) if h[1].key != "biases_missing"]
        else:
            before = STAGES[STAGES.index(stage) - 1]
            if before not in outputs:
                continue
            ok, hits = case.local(stage, outputs[before], outputs[stage], atol)
        if hits:
            own.append(named(hits[0][1], stage, hits[0][0]))
    if len(own) > 1:
        return own
    if best:
        return [named(best[1], best[2], best[3])]
    plain = [case.diagnose(stage, outputs[stage], atol) for stage in failing]
    return [next((d for d in plain if d.key), plain[0])] if plain else []  # else the most upstream failure


def _run(module, l1, l2, x, name, info=None) -> dict:
    """One forward; the stages it passes through: c_fc's output, c_proj's input (l2 None: none), the output
    (float32 numpy), each (1, T, width). A module that fails on (1, T, d) is fed (T, d), then one token's (d,) at
    a time (torch.mm, or a vector-only FFN); a tuple's first element is its output. info: where either, or an
    output in another dtype than the input's, is noted (it is judged in float32 all the same)."""
    seen, given = {}, x
    x = x.clone()  # its own copy: a module that writes into its input would change the next run's

    def keep(key, t, m):  # returns None: a hook that returns a value replaces the layer's output
        t = t.transpose(-1, -2) if pointwise_conv(m) else t  # a Conv1d's (B, channels, T) as (B, T, channels)
        seen.setdefault(key, []).append(t.detach().float().numpy().copy())
    hooks = [l1.register_forward_hook(lambda m, a, o: keep("c_fc", o, m))]
    if l2 is not None:
        hooks.append(l2.register_forward_pre_hook(lambda m, a: keep("gelu", a[0], m)))
    tupled = []  # whether an output was a tuple (its first element judged)

    def first_of(out):
        tupled.append(isinstance(out, (tuple, list)) and bool(out) and isinstance(out[0], torch.Tensor))
        return out[0] if tupled[-1] else out
    ways = [("(1, T, d)", lambda: first_of(module(x)))]
    if x.dim() == 3 and x.shape[0] == 1:
        ways += [("(T, d)", lambda: first_of(module(x[0]))),
                 ("one token's (d,) at a time", lambda: torch.stack([first_of(module(v)) for v in x[0]]))]
    first, way = None, None
    try:
        for fed, call in ways:
            seen.clear()
            tupled.clear()
            try:
                with torch.no_grad():
                    out = call()
                way = fed
                break
            except Exception as e:
                first = first or e
        else:
            who = super_missing(first)
            raise CheckError(super_message(who, first) if who else f"{name} failed on input of shape "
                             f"{tuple(x.shape)}: {type(first).__name__}: {first}".splitlines()[0]) from None
    finally:
        for h in hooks:
            h.remove()
    if not isinstance(out, torch.Tensor):
        raise CheckError(f"{name} returned a {type(out).__name__}; an FFN returns a tensor (B, T, n_embd)")
    T = x.shape[-2] if x.dim() > 1 else 1
    if info is not None and way != ways[0][0]:
        info.append(f"note: {name} fails on (1, T, d) input ({type(first).__name__}: {first}".splitlines()[0]
                    + f"), so it was fed {way}")
    if info is not None and not torch.equal(x, given):
        info.append(f"note: {name} writes into its input (the caller's tensor is overwritten): judged on a fresh "
                    f"copy each run")
    if info is not None and any(tupled):
        info.append(f"note: {name} returns a tuple: its first element is judged as the output")
    if info is not None and out.dtype != x.dtype:
        info.append(f"note: {name} returns {str(out.dtype).removeprefix('torch.')} for "
                    f"{str(x.dtype).removeprefix('torch.')} input (its weights' dtype); GPT-2 keeps the residual "
                    f"stream in its weights' dtype, so a block adding this output would change it: judged in float32 "
                    f"all the same")
    per_token = way.startswith("one token")
    stages = {k: (np.stack(v) if per_token else v[0]) for k, v in seen.items()}
    stages["ffn"] = out.detach().float().numpy()
    if way != ways[0][0]:  # as (1, T, width), the shape the stages are judged in
        stages = {k: v.reshape(1, T, -1) if v.size % T == 0 else v for k, v in stages.items()}
    return stages


# A function given its weights, as from-scratch numpy GPT-2s write it: picoGPT's ffn(x, c_fc, c_proj) with
# {"w": [in, out], "b": [out]} per layer (or HF's names, weight / bias), ffn(x, w1, b1, w2, b2), or one dict of
# them all (JAX's mlp(params, x) too: the input named x, inputs, h, ... and the params first).
ARG_STYLES = {1: ["a params dict of layer dicts {'c_fc': {'w', 'b'}, ...} (and HF's keys 'c_fc.weight', ...)",
                  "a params dict of layer dicts {'c_fc': {'weight', 'bias'}, ...}",
                  "a params dict of flax's layer dicts {'c_fc': {'kernel', 'bias'}, ...}"],
              2: ["picoGPT's dicts {'w', 'b'}", "dicts {'weight', 'bias'}", "flax's dicts {'kernel', 'bias'}"],
              4: ["arrays w1, b1, w2, b2"]}  # by weight arguments
INPUT_NAMES = {"x", "xs", "inputs", "input", "h", "hidden", "hidden_states", "x_in", "tokens", "activations"}


def _params(fn) -> list:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return [None]  # unknown: not taken for a factory


def weight_params(fn) -> list:
    """The names of fn's required positional parameters after the input: [] for a GELU f(x)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C function: taken as f(x)
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty][1:]


def plain_class(cls):
    """A plain (numpy) FFN class as a function of x and its weights, or None: seed 001's FFN struct written in
    Python, `FFN(w1, b1, w2, b2).forward(x)` (or its __call__), its weights the __init__'s parameters."""
    names = weight_params(cls.__init__)  # after self
    called = any("__call__" in vars(k) for k in cls.__mro__ if k is not object)
    run = "forward" if callable(getattr(cls, "forward", None)) else "__call__" if called else None
    if run is None or len(names) not in (2, 4):  # one argument is a config's, not a params dict's
        return None

    def ffn(x, *weights):
        return getattr(cls(*weights), run)(x)
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    ffn.__signature__ = inspect.Signature([inspect.Parameter(n, kind) for n in ["x", *names]])
    ffn.__module__ = cls.__module__  # its file, where a picoGPT gpt2() may call it
    return ffn


def _signature(fn) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _function_args(n: int, style: str, w: dict, lib: str, layout: str) -> list:
    """fn's weight arguments in one calling style: numpy or torch, weights [in, out] (x @ w) or [out, in]."""
    def arr(a, transpose=False):  # a copy each call: a function that writes into its weights writes into its own
        a = a.T.copy() if transpose else a.copy()
        return torch.from_numpy(np.ascontiguousarray(a)) if lib == "torch" else a
    t = layout == "[out, in]"
    w1, b1, w2, b2 = arr(w["c_fc.weight"], t), arr(w["c_fc.bias"]), arr(w["c_proj.weight"], t), arr(w["c_proj.bias"])
    if n == 4:
        return [w1, b1, w2, b2]
    keys = ("w", "b") if "'w'" in style else ("kernel", "bias") if "'kernel'" in style else ("weight", "bias")
    layers = [dict(zip(keys, (w1, b1))), dict(zip(keys, (w2, b2)))]  # each exactly its keys: linear(x, **c_fc)
    if n == 2:
        return layers
    # one dict: the layer dicts, and every flat name a course gives the four (HF's keys, w1 ...), flax's variables
    params = {"c_fc": layers[0], "c_proj": layers[1], "c_fc.weight": w1, "c_fc.bias": b1, "c_proj.weight": w2,
              "c_proj.bias": b2, "w1": w1, "b1": b1, "w2": w2, "b2": b2}
    return [{**params, "params": dict(params), "mlp": dict(params)}]


FEEDS = ("(T, d)", "(1, T, d)", "one token's (d,) at a time")


def _feed(call, x, feed: str):
    """call(input) for x (T, d) fed one way (FEEDS), its output as a (T, width) float32 array."""
    T = x.shape[0]
    if feed == FEEDS[0]:
        out = call(x)
    elif feed == FEEDS[1]:
        out = call(x[None])
    else:
        out = [np.asarray(call(v), dtype=np.float32) for v in x]
        return np.stack(out).reshape(T, -1) if out and out[0].ndim == 1 else np.asarray(out)
    out = np.asarray(out, dtype=np.float32)
    return out.reshape(T, -1) if feed != FEEDS[0] and out.size % max(T, 1) == 0 else out


def _beside_a_gpt2(fn) -> bool:
    """Whether fn's file holds a whole GPT-2 function (picoGPT's gpt2(inputs, wte, wpe, blocks, ln_f, n_head)),
    which calls an FFN with numpy arrays and weights [in, out]: an FFN that fails so is worth a note there."""
    module = sys.modules.get(getattr(fn, "__module__", None))
    return any(inspect.isfunction(f) and is_model_function(weight_params(f)) for f in vars(module).values()) \
        if module is not None else False


def check_function(fn, name: str, case: FFNCase, atol: float = GOLDEN_ATOL) -> Report:
    """An FFN written as a function of the input and its weights (ARG_STYLES), fed the case's weights in the first
    calling style it accepts (numpy before torch, weights [in, out] before [out, in]) and the block's ln_2
    output as (T, n_embd) (else (1, T, n_embd), else a token at a time); its output is judged and diagnosed as a
    module's (its inner stages are not seen)."""
    names = weight_params(fn)
    styles = ARG_STYLES.get(len(names))
    sig = f"{name}{_signature(fn)}"
    if styles is None:
        raise CheckError(f"{sig} takes {len(names)} weight arguments after the input; check calls a GELU f(x), "
                         "picoGPT's ffn(x, c_fc, c_proj), ffn(x, w1, b1, w2, b2) or ffn(x, params) (a dict)")
    params_first = len(names) == 1 and names[0] in INPUT_NAMES  # JAX's apply(params, x)

    def prepared(weights, x, style, lib, layout) -> tuple:
        """(fn's call on its own copy of the weights in one calling style, its own copy of x): each run its own,
        so a function writing into its input or its weights changes no other run."""
        args = _function_args(len(names), style, weights, lib, layout)
        call = (lambda v: fn(args[0], v)) if params_first else (lambda v: fn(v, *args))
        return call, torch.from_numpy(x.copy()) if lib == "torch" else x.copy()
    x2 = case.x[0]
    T, d = x2.shape
    hidden = case.weights["c_fc.weight"].shape[1]
    first_error, errors = None, {}  # errors: each library's first, so a torch-only function's own error is seen
    for style in styles:
        for lib in ("numpy", "torch"):
            ran = []  # square weights (n_inner == n_embd): a layout's failing report, then the other's
            for layout in ("[in, out]", "[out, in]"):
                error, writes = None, False
                for feed in FEEDS:
                    try:
                        out = []
                        for _ in range(2):
                            call, x = prepared(case.weights, x2, style, lib, layout)
                            with torch.no_grad():
                                out.append(_feed(call, x, feed))
                            writes = writes or not np.array_equal(np.asarray(x), x2)
                        error = None
                        break
                    except Exception as e:
                        error = error or f"{type(e).__name__}: {e}".splitlines()[0]
                how = f"called with {lib} {style}, weights {layout}" + (f", input fed {feed}" if feed != FEEDS[0]
                                                                        else "")
                if not error and out[0].shape == (T, hidden) and hidden != d:  # it stops after the activation
                    info = [f"a function: {sig}, {how}",
                            f"fed {case.source} layer {case.layer}'s ln_2 output ({T}, {d})"]
                    return no_proj_report(name, info, [], out[0].shape, d)
                if not error and out[0].shape != (T, d):
                    error = f"it returned shape {out[0].shape} for input ({T}, {d})"
                if error:
                    first_error = first_error or error
                    errors.setdefault(lib, error)
                    continue
                info = [f"a function: {sig}, {how}" + (" (F.linear's layout)" if layout == "[out, in]" else
                                                       " (x @ w, HF's Conv1D)"),
                        f"fed {case.source} layer {case.layer}'s ln_2 output ({T}, {d}); compared with HF GPT-2's "
                        f"own stages, tolerance {atol:.0e}"]
                if writes:
                    info.append("note: it writes into its input (the caller's array is overwritten): judged on a "
                                "fresh copy each run")
                if first_error and _beside_a_gpt2(fn):  # picoGPT's gpt2() calls it with numpy arrays, [in, out]
                    info.append(f"note: called with numpy arrays and weights [in, out], as picoGPT's own gpt2() calls "
                                f"it, it fails: {first_error}")
                first, again = ({"ffn": o[None]} for o in out)
                unseen = "not seen: a function's inner values"
                report = _judge(name, info, first, again, case, atol, unseen)

                def run(probe, style=style, lib=lib, layout=layout, feed=feed):
                    def once():
                        return {"ffn": _feed(*prepared(probe.weights, probe.x[0], style, lib, layout), feed)[None]}
                    try:
                        with torch.no_grad():
                            return [once(), once()]
                    except Exception as e:
                        raise CheckError(f"{name} passed, then failed on the same tokens scaled (c_fc's outputs to "
                                         f"|x| ~ {PROBE_REACH:g}): {type(e).__name__}: {e}".splitlines()[0]) from None
                report = _widen(report, case, atol, unseen, run, pass_through=True)

                def longer(xs, style=style, lib=lib, layout=layout):
                    call, xs = prepared(case.weights, xs, style, lib, layout)
                    with torch.no_grad():
                        out = call(xs)
                    return out.detach().float().numpy() if isinstance(out, torch.Tensor) else out
                report = shaped(report, case, atol, longer)
                if report.passed or hidden != d:
                    return report
                ran.append(report)
            if len(ran) == 2:
                return layout_choice(ran, "its weights are", every_layer=True)
            if ran:  # one layout ran and failed, the other raised
                return ran[0]
    raise CheckError(f"{sig} failed in every calling style check knows ({'; '.join(styles)}; numpy or torch; "
                     f"weights [in, out] or [out, in]; input (T, d), (1, T, d) or a token at a time); with numpy "
                     f"arrays first: {errors['numpy']}; with torch tensors first: {errors['torch']}")


def check_picogpt(fn, name: str, names: list, source: str, case_of, cfg: Config):
    """A whole GPT-2 function (check_model_function); where a block diverges, the FFN and GELU functions of the
    same file (picoGPT's ffn and gelu), if it has them, are checked on that block and what they get wrong is
    named."""
    report = check_model_function(fn, name, names, source)
    block = (report.first or {}).get("layer")
    if block is None and (not report.passed or not _blind_at(case_of, 0)):
        return report  # a failure with no block to look at, or a pass on a prompt that tells the FFN's mistakes
    module = sys.modules.get(getattr(fn, "__module__", None))
    found = []
    ffn, gelu = getattr(module, "ffn", None), getattr(module, "gelu", None)
    if callable(gelu) and not weight_params(gelu):
        r = check_gelu(gelu, "gelu", cfg.gelu_approximate, [])
        found += [] if r.passed else [f"its gelu: {r.verdict.split(': ', 1)[1]}"]
    if callable(ffn) and len(weight_params(ffn)) in ARG_STYLES:
        r = check_function(ffn, "ffn", case_of(block or 0))  # on a pass, block 0's (as probe_ffn for a module)
        found += [] if r.passed else [f"its ffn: {r.verdict.split(': ', 1)[1]}"]
    if block is None:  # a pass on this prompt: its gelu and ffn alone tell what the prompt's small values did not
        if found:
            report.verdict = ("FAIL (its parts alone, checkpoint 06): every stage passed on this prompt, whose FFN "
                              "inputs are too small to tell; " + "; ".join(found))
            at = next((i for i, row in enumerate(report.rows) if row.checkpoint > "06"), len(report.rows))
            report.rows.insert(at, ModelRow("06", "gelu and ffn functions alone", "0", (), float("nan"), None, "FAIL",
                                            "; ".join(found)))
            report.passed = False
            report.first = {"layer": 0, "stage": "ffn", "checkpoint": "06", "what": "its gelu and ffn alone"}
        return report
    block_fn = getattr(module, "transformer_block", None)
    if not found and callable(block_fn):  # the block alone, on HF's input to it: a residual, a norm, attention
        wrong = block_function_mistake(block_fn, source, block)
        found += [f"its transformer_block: {wrong}"] if wrong else []
    if found:
        report.verdict += "; " + "; ".join(found)
    elif callable(ffn) or callable(gelu):
        report.verdict += ("; its ffn and gelu pass alone, so look at the block's attention, layer norms or "
                           "residual adds")
    return report


def _scalars(fn, x):
    """fn on each element as a Python float (a GELU written with math.tanh / math.erf), as a float64 array."""
    return np.array([float(fn(v)) for v in x.tolist()])


def _apply(fn, x, name):
    """fn on the float32 tensor x; a GELU that takes only numpy arrays (np.vectorize) or only Python floats (math's
    functions) is called so, its output judged as a tensor of the same points."""
    y = first = failed = object()  # `failed`: no way of calling it ran (None is a GELU's answer, judged below)
    with torch.no_grad():
        for arg in (lambda: fn(x), lambda: fn(x.numpy().copy()), lambda: _scalars(fn, x)):
            try:
                y = arg()
                break
            except Exception as e:
                first = e if first is failed else first
    if y is failed:
        raise CheckError(f"{name} has no linear layer, so check takes it for a GELU, but it fails on a float "
                         f"tensor of shape {tuple(x.shape)}: {type(first).__name__}: {first}".splitlines()[0])
    if isinstance(y, np.ndarray) and y.dtype.kind == "f":
        y = torch.from_numpy(np.asarray(y, np.float64))
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        raise CheckError(f"{name} has no linear layer, so check takes it for a GELU, but it maps a tensor of "
                         f"shape {tuple(x.shape)} to {got}: not elementwise")
    return y.detach().double().numpy()


def check_gelu(fn, name: str, approximate: str, built: list, atol: float = GOLDEN_ATOL) -> Report:
    """Seed 000's spot values, max error against every known form over the grid, and which form it is."""
    was_training = getattr(fn, "training", None)
    if was_training is not None:
        fn.eval()
    try:
        x = torch.tensor(GELU_GRID, dtype=torch.float32)
        arg = x.clone()  # each call its own tensor: a GELU may write its result into its input (x.mul_(...))
        got = _apply(fn, arg, name)
        if not torch.equal(arg, x):
            built = built + ["it writes its result into its input (in place): the caller's tensor is overwritten"]
        again = _apply(fn, x.clone(), name)  # the same points again: a GELU keeps no state and draws nothing
        same = (again == got) | (np.isnan(again) & np.isnan(got))  # (an overflow's NaN/Inf twice is the same)
        differ = 0.0 if same.all() else float(np.nan_to_num(np.abs(again - got)[~same], nan=np.inf).max())
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        if not differ and not np.allclose(_apply(fn, x[perm].clone(), name), got[perm.numpy()], atol=1e-6,
                                          equal_nan=True):
            raise CheckError(f"{name} has no linear layer, so check takes it for a GELU, but its output at a point "
                             "depends on the other points: not elementwise")
        spot = np.round(_apply(fn, torch.tensor(SPOT_X), name), 4) + 0.0  # + 0.0: -0.0 prints as 0.0
    finally:
        if was_training is not None:
            fn.train(was_training)
    target = TARGET[approximate]
    rows = []
    bad = ~np.isfinite(got)
    if bad.any():
        rows.append(Row("finite", (len(x),), float("nan"), None, "FAIL",
                        f"NaN/Inf at x = {', '.join(f'{v:g}' for v in GELU_GRID[bad][:4])}"))
    if target == "tanh":
        ok = np.allclose(spot, SPOT_Y, atol=1e-9)
        rows.append(Row("seed 000 spot values x = -2..2", (5,), float(np.abs(spot - SPOT_Y).max()), None,
                        "PASS" if ok else "FAIL", f"got {spot.tolist()}" + ("" if ok else f", expected {SPOT_Y}")))
    with np.errstate(over="ignore"):
        errors = {k: float(np.abs(got - f(GELU_GRID)).max()) for k, (f, *_) in FORMS.items()}
        # which form it is: relative to |x| past 1 (float32's own rounding at x = 400 is 1.5e-5)
        close = {k: float((np.abs(got - f(GELU_GRID)) / np.maximum(1.0, np.abs(GELU_GRID))).max())
                 for k, (f, *_) in FORMS.items()}
    for k in dict.fromkeys([target, "tanh", "exact"]):
        judged = k == target
        rows.append(Row(f"vs {FORMS[k][1]}", (len(x),), errors[k], atol if judged else None,
                        ("PASS" if errors[k] <= atol else "FAIL") if judged else "--"))
    best = min(close, key=close.get)
    info = built + [f"float32 over {len(x)} points: -10..10 every 0.005 and |x| 10.25..400; target: "
                    f"{FORMS[target][2]}"]
    off = best == target and errors[target] > atol  # near the form relative to |x|, beyond the bar where x is large
    if bad.any():
        i = int(np.argmax(bad))
        form, fix = f"it gives {got[i]:g} at x = {GELU_GRID[i]:g} (NaN/Inf: an overflow, as tanh through exp?)", ""
    elif close[best] <= FORM_ATOL and not off:
        the = "" if FORMS[best][2].startswith("no ") else "the "  # "no activation (identity)"
        form = f"it is {the}{FORMS[best][2]}: max error {close[best]:.1e}"  # relative to |x| past 1
        fix = "" if best == target else f"; {fix_for(best, target)}"
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            want = FORMS[target][0](GELU_GRID)
            i = int(np.nanargmax(np.abs(got - want)))
        near = f"near the {FORMS[best][2]} relative to |x| ({close[best]:.1e}) but" if off else \
            f"it matches no known form (closest: {FORMS[best][2]}, max error {close[best]:.1e});"
        form = f"{near} worst point x = {GELU_GRID[i]:g}: got {got[i]:.6g}, {FORMS[target][1]} gives {want[i]:.6g}"
        fix = ""
    if differ:
        rows.append(Row("2 calls identical", (len(x),), differ, None, "FAIL",
                        f"the same {len(x)} points twice: outputs up to {differ:.3g} apart"))
    report = Report("gelu", name, info, rows, "")
    report.verdict = f"{'PASS' if report.passed else 'FAIL'}: {form}{fix}"
    if differ:
        report.verdict += (f"; but two calls on the same input differ (by up to {differ:.3g}): it keeps state "
                           "between calls (a counter, a cache) or draws randomness, and a GELU is a function of x")
    return report
