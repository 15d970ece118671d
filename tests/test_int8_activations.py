"""Integer dot products on int8 activations (I8A8 / I4A8): every instruction-set build this CPU runs against a
torch reference of the same quantization, bit-exact int32 sums where the scales make the float epilogue exact,
odd sizes, clear errors, and the whole GPT-2 on both routes."""

import numpy as np
import pytest
import torch

from conftest import SMALL, hf_model, native_isas
from gpt2ffn import ConfigError, quantize
from gpt2ffn.kernels import packed as kp
from gpt2ffn.kernels.formats import Packed, fake_quantize_activations, quantize_activations
from gpt2ffn.model import GPT2

_C = kp._C
pytestmark = pytest.mark.skipif(kp.WHY_NOT_NATIVE is not None, reason=str(kp.WHY_NOT_NATIVE))


ISAS = native_isas()


@pytest.fixture(params=ISAS)
def isa(request):
    old = _C.set_isa(request.param)
    yield request.param
    _C.set_isa(old)


def native(x, p):
    return _C.linear(x, p.w, p.scale, p.bias, p.format, p.N, p.group)


def reference64(x, p, w, b):
    """float64: the fake-quantized activations times the quantized weights, plus bias."""
    return torch.from_numpy(kp.reference(x, p, w, b))


def test_the_builds_this_cpu_has_are_all_tested():
    assert "avx2" in ISAS  # every x86-64 CPU that runs the native kernels runs the AVX2 build
    if _C.isa() == "avx512":
        assert "avx512" in ISAS
    if _C.isa() == "avx512amx":
        assert {"avx512amx", "avx512"} <= set(ISAS)


def test_each_build_runs_its_own_instruction():
    """Each build's integer sums run on the instruction it is named for, as compiled: the AVX-VNNI build once ran
    the maddubs path (a target pragma defines no __AVXVNNI__), which only equal outputs could not show."""
    want = {"avx512amx": "tdpbssd", "avx512": "vpdpbusd (AVX-512", "avxvnni": "vpdpbusd (AVX-VNNI",
            "avx2": "vpmaddubsw"}
    for name in ISAS:
        old = _C.set_isa(name)
        try:
            assert _C.int8_dot().startswith(want[name]), (name, _C.int8_dot())
        finally:
            _C.set_isa(old)


@pytest.mark.skipif("avx512amx" not in ISAS, reason="this CPU (or its kernel) gives no AMX-INT8 tiles")
@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("K,N,group", [(768, 192, None), (200, 64, None), (96, 130, 8), (128, 64, 64), (256, 64, 128),
                                       (544, 64, None), (96, 64, 32), (32, 128, None)])
@pytest.mark.parametrize("act", ["", "tanh", "relu"])
def test_amx_tiles_equal_the_vnni_kernels_bit_for_bit(precision, K, N, group, act):
    """Blocks of 16 rows on AMX tiles, the rows after them on VNNI; groups of 20 (200 inputs), 8 and 64 fit a
    tile, 128 does not (all VNNI); an odd count of groups (17, 3) and a single one (the pipelined loop's ends):
    every row equals the VNNI build's, and row r of any batch equals row r alone."""
    g = torch.Generator().manual_seed(K + N)
    w, b, x = torch.randn(K, N, generator=g), torch.randn(N, generator=g), 2 * torch.randn(40, K, generator=g)
    p = Packed(w, b if act != "relu" else None, precision, group=group, activations="int8")
    outs = {}
    for name in ("avx512amx", "avx512"):
        old = _C.set_isa(name)
        try:
            outs[name] = [_C.linear(x[:M], p.w, p.scale, p.bias, p.format, p.N, p.group, act) for M in (40, 16, 33)]
        finally:
            _C.set_isa(old)
    for a, v in zip(outs["avx512amx"], outs["avx512"]):
        assert torch.equal(a, v)
    full = outs["avx512amx"][0]
    assert torch.equal(outs["avx512amx"][1], full[:16]) and torch.equal(outs["avx512amx"][2], full[:33])
    # negative control: one weight byte changed changes the tiles' rows too
    p.w.view(-1)[0] ^= 1
    old = _C.set_isa("avx512amx")
    try:
        assert not torch.equal(_C.linear(x[:16], p.w, p.scale, p.bias, p.format, p.N, p.group, act), full[:16])
    finally:
        _C.set_isa(old)


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("K,N,M", [(768, 2304, 1), (96, 200, 7), (64, 64, 13), (256, 130, 37)])
def test_native_matches_reference_of_the_same_quantization(isa, precision, K, N, M):
    g = torch.Generator().manual_seed(K + N + M)
    w, b, x = torch.randn(K, N, generator=g), torch.randn(N, generator=g), 3 * torch.randn(M, K, generator=g)
    p = Packed(w, b, precision, activations="int8")
    y = native(x, p).double()
    want = reference64(x, p, w, b)
    assert y.shape == (M, N)
    err = float((y - want).abs().max() / want.abs().max())
    assert err < 2e-6, (isa, err)
    # negative control: the same weights on fp32 activations differ by the activations' rounding, ~1e-2
    p32 = Packed(w, b, precision)
    assert float((native(x, p32).double() - want).abs().max() / want.abs().max()) > 1e-3


def exact_case(precision, K, N, M, seed=0):
    """Inputs whose scales are powers of two (x: 2^-3, w: 2^-4), so that every float in the kernel's epilogue
    is exact and its output must equal the int32 sums times 2^-7 bit for bit. Row 0 is all +-127 times the
    weights' sign pattern: the largest sums maddubs can meet (saturation would show)."""
    g = torch.Generator().manual_seed(seed)
    xq = torch.randint(-127, 128, (M, K), generator=g)
    xq.view(M, K // 32, 32)[:, :, 0] = 127  # each group's max|x| is 127: d = 2^-3 exactly
    if precision == "int8":
        q = torch.randint(-127, 128, (K, N), generator=g)
        q.view(K // 32, 32, N)[:, 0] = -127
        w = q.float() / 16
    else:
        q = torch.randint(0, 16, (K, N), generator=g) - 8
        q.view(K // 32, 32, N)[:, 0] = -8  # the signed max the int4 scale is taken from: s = 2^-4
        w = q.float() / 16
    xq[0] = 127 * torch.where(q[:, 0] < 0, -1, 1)
    x = xq.float() / 8
    want = (xq.double() @ q.double()) / 128
    return x, w, want


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_int32_sums_bit_exact(isa, precision):
    x, w, want = exact_case(precision, 768, 200, 38)  # 38 rows: two blocks of 16 (AMX tiles) and 6 more
    p = Packed(w, None, precision, activations="int8")
    q, d = quantize_activations(x, p.group)
    assert torch.equal(d, torch.full_like(d, 0.125)) and torch.equal(q.float(), x * 8)
    y = native(x, p)
    assert torch.equal(y.double(), want), (isa, float((y.double() - want).abs().max()))
    # negative control: one weight byte changed changes an output
    p.w.view(-1)[0] ^= 1
    assert not torch.equal(native(x, p).double(), want)


@pytest.mark.parametrize("group", [32, 256, 512])
def test_int8_sums_exact_at_every_sign(isa, group):
    """The AVX2 build's int8 prefill takes |x| against q ^ sign(x) and adds back each row's sum of |x| over its
    negative x (qvec_avx2.h: qgroup_xsign, groups up to 256; larger ones take the sign trick): rows of all -127,
    all +127 and random signs against columns of all +127, all -127 and random q, in the prefill tiles of 8, 4,
    2 and 1 rows and in decode's one row. Scales are powers of two, so the outputs are the int32 sums exactly."""
    K, N, M = 1024, 128, 15
    g = torch.Generator().manual_seed(6)
    q = torch.randint(-127, 128, (K, N), generator=g)
    q.view(K // group, group, N)[:, 0] = -127  # every group's max |q| is 127: s = 2^-4
    q[:, 0], q[:, 1] = 127, -127
    xq = torch.randint(-127, 128, (M, K), generator=g)
    xq.view(M, K // group, group)[:, :, 1] = 127  # d = 2^-3
    xq[0], xq[1] = -127, 127  # -127 * 127 * 1024 in a sum: within float32's exact integers
    x, w = xq.float() / 8, q.float() / 16
    want = (xq.double() @ q.double()) / 128
    p = Packed(w, None, "int8", group=group, activations="int8")
    for rows in (M, 1):
        y = native(x[:rows], p)
        assert torch.equal(y.double(), want[:rows]), (isa, group, rows, float((y.double() - want[:rows]).abs().max()))
    p.w.view(-1)[5] ^= 1  # negative control: one weight byte changed changes an output
    assert not torch.equal(native(x, p).double(), want)


@pytest.mark.parametrize("group,act,bias,M", [(None, "", True, 21), (64, "tanh", False, 15), (128, "relu", True, 8),
                                             (8, "tanh", True, 3), (None, "", False, 2)])
def test_builds_agree_bit_for_bit(group, act, bias, M):
    """Every build computes the same int32 sums and the same epilogue: equal outputs, not merely close. Row
    counts cover the 256-bit builds' prefill tiles (8, 4, 2 and 1 rows), groups the int4 16-bit sums' chunks."""
    g = torch.Generator().manual_seed(3)
    w, b, x = torch.randn(384, 192, generator=g), torch.randn(192, generator=g), torch.randn(M, 384, generator=g)
    for precision in ("int8", "int4"):
        p = Packed(w, b if bias else None, precision, group=group, activations="int8")
        outs = {}
        for name in ISAS:
            old = _C.set_isa(name)
            try:
                outs[name] = _C.linear(x, p.w, p.scale, p.bias, p.format, p.N, p.group, act)
            finally:
                _C.set_isa(old)
        first = next(iter(outs.values()))
        assert all(torch.equal(first, y) for y in outs.values()), \
            (precision, {k: bool(torch.equal(first, y)) for k, y in outs.items()})


def test_int4_largest_sums_are_exact(isa):
    """int4 nibbles of 15 against activations of 127 in every position: the largest sums the maddubs build's
    16-bit partial sums (32 inputs before they widen) can meet."""
    K, N, M = 256, 64, 9
    w = torch.full((K, N), -0.875)
    w[::32] = 1.0  # each group's max |w| is +1: s = -1/8, so -0.875 is q = 7, the nibble 15
    x = torch.full((M, K), 1.0)
    p = Packed(w, None, "int4", activations="int8")
    want = w.double().sum(0).expand(M, N)
    assert torch.equal(native(x, p).double(), want), isa


def test_batch_invariant():
    g = torch.Generator().manual_seed(4)
    w, x = torch.randn(256, 320, generator=g), torch.randn(40, 256, generator=g)
    p = Packed(w, None, "int8", activations="int8")
    full = native(x, p)
    for rows in (1, 3, 5, 17):
        assert torch.equal(native(x[:rows], p), full[:rows]), rows


def special_rows(K=1024, M=5, seed=5):
    """Rows of K activations whose groups of 32 hold what quantization has edges for: all zeros (d = 0), exact
    ties (max 127, so 1 / d = 1 and 2.5 -> 2, -3.5 -> -4), one huge value beside tiny ones, and random rest."""
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed))
    x[:, 0:32] = 0.0
    ties = torch.tensor([127.0] + [k + 0.5 for k in range(-16, 15)])
    x[:, 32:64] = ties
    x[:, 64:96] = 1e-6
    x[:, 70] = 3e4
    x[1, 512:544] = -ties
    return x, ties


@pytest.mark.parametrize("K,group", [(1024, 32), (544, 32), (768, 24), (96, 8)])
def test_native_quantization_is_the_definition_bit_for_bit(isa, K, group):
    """q, d and the sums of q as each build's kernels read them (_C.quantize_activations) equal
    quantize_activations' definition exactly. K = 1024 and 544 run the AVX-512 builds' 16-groups-at-once
    quantizer (csrc/qlinear_avx512.cpp: quantize_16x32; 544: one block of 16 and one group alone); 24 and 8 the
    group-by-group one. The rows hold all-zero groups, exact ties, and a huge value beside tiny ones."""
    x, _ = special_rows(K=max(K, 544))
    x = x[:, :K].contiguous()
    q, d, sums = _C.quantize_activations(x, group)
    want_q, want_d = quantize_activations(x, group)
    assert torch.equal(d, want_d), (isa, float((d - want_d).abs().max()))
    assert torch.equal(q, want_q), (isa, int((q != want_q).sum()))
    assert torch.equal(sums, want_q.view(x.shape[0], K // group, group).sum(-1, dtype=torch.int32))
    # negative control: ties rounded away from zero (not to even) change q
    away = torch.trunc(x / want_d.repeat_interleave(group, 1) + 0.5 * torch.sign(x)).clamp(-127, 127)
    assert not torch.equal(q, torch.where(want_d.repeat_interleave(group, 1) == 0, 0.0, away).to(torch.int8))


def test_native_quantization_refuses_what_it_cannot_lay_out():
    with pytest.raises(RuntimeError, match="multiple of 4"):
        _C.quantize_activations(torch.randn(2, 60), 30)


def test_sixteen_groups_at_once_equal_every_build():
    """Through the integer kernels: every build's outputs equal (on an AVX-512 CPU the others include avx2's
    group-by-group quantizer)."""
    x, _ = special_rows(M=21)
    w = torch.randn(1024, 192, generator=torch.Generator().manual_seed(7))
    p = Packed(w, None, "int8", activations="int8")
    outs = {}
    for name in ISAS:
        old = _C.set_isa(name)
        try:
            outs[name] = native(x, p)
        finally:
            _C.set_isa(old)
    first = next(iter(outs.values()))
    assert all(torch.equal(first, y) for y in outs.values()), {k: bool(torch.equal(first, y)) for k, y in outs.items()}


def test_activation_quantization_matches_its_definition():
    x = torch.tensor([[0.0] * 32 + [1.0, -2.0, 0.5] + [0.0] * 29])
    q, d = quantize_activations(x, 32)
    assert d.tolist() == [[0.0, pytest.approx(2 / 127)]]
    assert q[0, :32].abs().sum() == 0 and q[0, 32:35].tolist() == [64, -127, 32]  # 63.5 rounds to even
    np.testing.assert_allclose(fake_quantize_activations(x, 32)[0, 33], -2.0, rtol=1e-6)


def test_k_not_a_multiple_of_32_takes_a_smaller_group_or_says_why():
    w = torch.randn(40, 64)
    assert Packed(w, None, "int8", activations="int8").group == 20   # largest divisor <= 32, a multiple of 4
    assert Packed(w, None, "int4", activations="int8").group == 8    # ... a multiple of 8
    x = torch.randn(3, 40)
    for precision in ("int8", "int4"):
        p = Packed(w, None, precision, activations="int8")
        assert float((native(x, p).double() - reference64(x, p, w, None)).abs().max()) < 1e-5
    with pytest.raises(ConfigError, match=r"int4 with int8 activations needs a number of inputs per layer divisible "
                                          r"by 8 \(a 4-byte word holds 8 weights\); this layer has 36"):
        Packed(torch.randn(36, 64), None, "int4", activations="int8")
    with pytest.raises(ConfigError, match="int8 with int8 activations group size 30 must be a multiple of 4 and "
                                          "divide the layer's 120 inputs"):
        Packed(torch.randn(120, 64), None, "int8", group=30, activations="int8")
    with pytest.raises(ConfigError, match="int8 activations need int8 or int4 weights, not bf16"):
        Packed(w, None, "bf16", activations="int8")
    with pytest.raises(ConfigError, match="activations 'int4' is not supported; known: fp32, int8"):
        Packed(w, None, "int8", activations="int4")


def test_native_checks_the_group():
    p = Packed(torch.randn(64, 64), None, "int4", activations="int8")
    with pytest.raises(RuntimeError, match="group 4 must divide K=64 and be a multiple of 8"):
        _C.linear(torch.randn(1, 64), p.w, p.scale, p.bias, p.format, p.N, 4)
    with pytest.raises(RuntimeError, match="unknown instruction set avx9"):
        _C.set_isa("avx9")


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_gpt2_native_matches_torch_route(precision):
    hf = hf_model(SMALL, seed=3)
    model = GPT2(SMALL).eval()
    model.load_state_dict(hf.state_dict())
    quantize(model, precision, activations="int8")
    # lm_head: int8 weights; with int4 int8 activations (I8A8), with int8 fp32 ones (I8: precision.quantize)
    assert model.activations == "int8" and model.lm_head.packed.format == {"int4": 4, "int8": 2}[precision]
    assert model.transformer.h[0].mlp.c_fc.packed.activations == "int8"
    ids = torch.randint(0, SMALL.vocab_size, (2, 9), generator=torch.Generator().manual_seed(7))
    layers = [m for m in model.modules() if getattr(m, "packed", None) is not None]
    got = {}
    for route in ("native", "torch"):
        for m in layers:
            m.packed.route = {"decode": route, "prefill": route}
        with torch.no_grad():
            got[route] = model(ids)
    assert float((got["native"] - got["torch"]).abs().max() / got["torch"].abs().max()) < 1e-5
    with torch.no_grad():
        want = hf(ids).logits
    err = float((got["native"] - want).abs().max() / want.abs().max())
    assert 1e-4 < err < 0.1, err  # quantized, so not fp32's numbers, but close to them


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_weights_unpack_from_the_word_layout(precision):
    """A layer held once answers state_dict() and the tied embeddings from Packed.weights(): the int8-activation
    word layout unpacks to exactly the values of the float-activation layout (same groups, same rounding)."""
    w = torch.randn(96, 80, generator=torch.Generator().manual_seed(3))
    words, plain = Packed(w, None, precision, activations="int8"), Packed(w, None, precision, activations="fp32")
    assert words.w.shape != plain.w.shape                       # really another layout
    assert torch.equal(words.weights(), plain.weights())
    cols = torch.tensor([0, 17, 63, 64, 79])
    assert torch.equal(words.weights(cols), plain.weights(cols))
    assert not torch.equal(words.weights(), w)                  # and they are the rounded values, not w
