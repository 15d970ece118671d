"""gpt2ffn._C.causal_attention (csrc/linear_impl.h: attend_causal), which CausalSelfAttention uses for fp32
inference on the CPU: against float64 attention with the causal mask in every build this CPU runs, with and
without cached keys, odd head widths and lengths; a shifted mask as negative control; the model's logits
against SDPA's; clear errors."""

import pytest
import torch
import torch.nn.functional as F

from conftest import SMALL, native_isas
from gpt2ffn.kernels import packed as kp
from gpt2ffn.model import GPT2, causal_mask

_C = kp._C
pytestmark = pytest.mark.skipif(kp.WHY_NOT_NATIVE is not None, reason=str(kp.WHY_NOT_NATIVE))


def reference(q, k, v, past):
    T = q.shape[2]
    y = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=causal_mask(T, past))
    return y.transpose(1, 2).reshape(q.shape[0], T, -1)


def views(B, H, T, past, hd, seed):
    """q as c_attn's output splits it, k and v as views of a longer cache: the strides the model passes."""
    g = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(B, T, 3 * H * hd, generator=g))[..., :H * hd].view(B, T, H, hd).transpose(1, 2)
    k = torch.randn(B, H, past + T + 5, hd, generator=g)[:, :, :past + T]
    v = torch.randn(B, H, past + T + 5, hd, generator=g)[:, :, :past + T]
    return q, k, v


@pytest.mark.parametrize("isa", native_isas())
@pytest.mark.parametrize("B,H,T,past,hd", [(1, 12, 128, 0, 64), (2, 3, 5, 7, 16), (1, 2, 70, 0, 80),
                                           (3, 4, 1, 30, 48), (1, 1, 1, 0, 64), (2, 2, 67, 64, 32)])
def test_matches_float64_attention(isa, B, H, T, past, hd):
    q, k, v = views(B, H, T, past, hd, seed=B + H + T + past + hd)
    old = _C.set_isa(isa)
    try:
        got = _C.causal_attention(q, k, v)
    finally:
        _C.set_isa(old)
    assert got.shape == (B, T, H * hd)
    assert (got.double() - reference(q, k, v, past)).abs().max() < 1e-5
    if past:  # negative control: one key more or less for every query is far off
        assert (got.double() - reference(q, k[:, :, 1:], v[:, :, 1:], past - 1)).abs().max() > 1e-2


def test_gpt2_logits_equal_sdpa_s():
    model = GPT2(SMALL).eval()
    ids = torch.randint(0, SMALL.vocab_size, (2, 31), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        native = model(ids)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("gpt2ffn.model.runs_causal_attention", lambda *a: False)
            sdpa = model(ids)
    assert (native - sdpa).abs().max() <= 1e-5 * sdpa.abs().max()
    assert not torch.equal(native, sdpa)  # really two computations


def test_gradients_still_go_through_sdpa():
    q, k, v = views(1, 2, 4, 0, 16, seed=2)
    q.requires_grad_(True)
    assert not kp.runs_causal_attention(q, k, v, 0.0)
    assert not kp.runs_causal_attention(q.detach(), k, v, 0.1)  # dropout
    assert kp.runs_causal_attention(q.detach(), k, v, 0.0)


def test_bad_shapes_are_named():
    q, k, v = views(1, 2, 4, 0, 16, seed=3)
    with pytest.raises(RuntimeError, match=r"k and v must be \(1, 2, past \+ 4, 16\)"):
        _C.causal_attention(q, k[:, :, :3], v[:, :, :3])
    q, k, v = views(1, 2, 4, 0, 24, seed=3)
    with pytest.raises(RuntimeError, match="head width 24 must be a multiple of 16"):
        _C.causal_attention(q, k, v)


@pytest.mark.parametrize("isa", native_isas())
def test_fp16_keys_and_values_are_read_as_their_widened_values(isa):
    """An fp16 KV cache's keys and values, widened as they are read: bit for bit the fp32 call on the widened ones."""
    q, k, v = views(2, 3, 37, 11, 32, seed=4)
    k16, v16 = k.half(), v.half()
    old = _C.set_isa(isa)
    try:
        got, want = _C.causal_attention(q, k16, v16), _C.causal_attention(q, k16.float(), v16.float())
        assert torch.equal(got, want)
        assert not torch.equal(got, _C.causal_attention(q, k, v))  # negative control: the rounding is seen
    finally:
        _C.set_isa(old)
    assert kp.runs_causal_attention(q, k16, v16, 0.0) and not kp.runs_causal_attention(q, k16, v, 0.0)
    with pytest.raises(RuntimeError, match="k and v must both be float32 or both float16"):
        _C.causal_attention(q, k16, v)


@pytest.mark.parametrize("isa", native_isas())
@pytest.mark.parametrize("half", [True, False])
def test_a_later_tokens_overflowed_value_never_reaches_an_earlier_token(isa, half):
    """A value past fp16's 65504 is inf in an fp16 cache. The queries before it in the same block (8, then a
    tail of 4, in the AVX-512 builds; 2 in the AVX2 ones) must not weigh it, not even by 0 (0 * inf = NaN): their
    outputs equal the prompt cut before that token, bit for bit (NaN where an earlier cut already gave NaN). The
    queries that do see it get inf or NaN, so the inf is really there."""
    B, H, T, past, hd = 1, 2, 37, 11, 64
    q, k, v = views(B, H, T, past, hd, seed=5)
    if half:
        k, v = k.half(), v.half()
    v = v.clone()
    cuts = (5, 13, 35)  # not first in their block for either build: 8-query blocks, the 4-query tail, pairs
    for t in cuts:
        v[:, :, past + t, 3] = float("inf")
    old = _C.set_isa(isa)
    try:
        got = _C.causal_attention(q, k, v)
        for t in cuts:
            prefix = _C.causal_attention(q[:, :, :t], k[:, :, :past + t], v[:, :, :past + t])
            torch.testing.assert_close(got[:, :t], prefix, rtol=0, atol=0, equal_nan=True, msg=str(t))
            assert not torch.isfinite(got[:, t]).all(), t  # the token itself sees its own value
    finally:
        _C.set_isa(old)
