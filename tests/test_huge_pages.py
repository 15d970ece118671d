"""Packed weights and KV caches on transparent huge pages (kernels/formats.py: on_huge_pages, packing_arena,
huge_zeros): the same values, small layers side by side in one region inside quantize(), nothing changed for
tensors that stay where they are, and the model's outputs unchanged."""

import mmap

import pytest
import torch

import gpt2ffn.kernels.formats as F
from conftest import SMALL
from gpt2ffn import Config, quantize
from gpt2ffn.kernels.formats import HUGE_PAGE, on_huge_pages, packing_arena
from gpt2ffn.model import GPT2
from gpt2ffn.serving.kv_cache import KVCache, PagedKVCache

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this system")


def test_a_large_tensor_moves_with_its_values():
    t = torch.randn(HUGE_PAGE // 4 + 100)  # 2 MiB and a bit
    h = on_huge_pages(t)
    assert h is not t and torch.equal(h, t) and h.is_contiguous()
    assert h.data_ptr() % HUGE_PAGE == 0
    small = torch.randn(100)
    assert on_huge_pages(small) is small  # outside an arena, under 2 MiB: left where it is


def test_an_arena_puts_tensors_side_by_side_and_outlives_its_block():
    ts = [torch.randn(n) for n in (1000, 333, 70000)]
    want = [t.clone() for t in ts]
    with packing_arena():
        with packing_arena():  # nested: the same region
            hs = [on_huge_pages(ts[0])]
        hs += [on_huge_pages(t) for t in ts[1:]]
    assert all(h.data_ptr() % 64 == 0 for h in hs)
    base = hs[0].untyped_storage().data_ptr()
    assert all(h.untyped_storage().data_ptr() == base for h in hs)  # one region
    del ts
    assert all(torch.equal(h, w) for h, w in zip(hs, want))  # after the context, without the originals
    small = torch.randn(100)
    assert on_huge_pages(small) is small  # the arena is closed: back to tensors staying where they are


def test_an_arena_without_huge_pages_leaves_tensors_where_they_are(monkeypatch):
    monkeypatch.setattr(F, "_advised", lambda nbytes: None)
    ts = [torch.randn(n) for n in (1000, 70000)]
    with packing_arena():
        assert all(on_huge_pages(t) is t for t in ts)
    assert on_huge_pages(ts[0]) is ts[0]


def test_quantized_model_unchanged_by_where_its_weights_live():
    model = GPT2(SMALL).eval()
    ids = torch.randint(0, SMALL.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    out = {}
    for mode in ("huge", "plain"):
        m = GPT2(SMALL).eval()
        m.load_state_dict(model.state_dict())
        with pytest.MonkeyPatch.context() as mp:
            if mode == "plain":
                mp.setattr(F, "on_huge_pages", lambda t: t)
            quantize(m, "int8")
        with torch.no_grad():
            out[mode] = m(ids)
        if mode == "huge":
            ws = [mod.packed.w for mod in m.modules() if getattr(mod, "packed", None) is not None]
            assert len({w.untyped_storage().data_ptr() for w in ws}) == 1  # the small model fits one region
    assert torch.equal(out["huge"], out["plain"])


def test_huge_zeros_are_zeros_on_huge_pages_and_plain_without():
    z = F.huge_zeros((3, 4, 1000, 64))  # 3 MiB
    assert z.shape == (3, 4, 1000, 64) and z.dtype == torch.float32 and z.is_contiguous()
    assert z.data_ptr() % HUGE_PAGE == 0 and not z.any()
    z[2, 3, 999] = 1.5
    assert float(z.sum()) == 64 * 1.5
    assert not F.huge_zeros((10,)).any()  # under 2 MiB: torch.zeros
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "_advised", lambda nbytes: None)
        assert not F.huge_zeros((3, 4, 1000, 64)).any()  # no huge pages: torch.zeros


def test_the_kv_caches_live_on_huge_pages():
    cfg = Config(n_layer=2)  # 124M's widths: 3 MiB per layer's keys at 1024 positions
    for cache in (KVCache(cfg, 1), PagedKVCache(cfg, 64, 16)):
        assert all(t.data_ptr() % HUGE_PAGE == 0 and not t.any() for t in cache.k + cache.v)
