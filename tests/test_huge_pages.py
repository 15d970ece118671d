"""Packed weights and KV caches on transparent huge pages (kernels/formats.py: on_huge_pages, packing_arena,
huge_zeros): the same values, small layers side by side in one region inside quantize(), nothing changed for
tensors that stay where they are, and the model's outputs unchanged."""

import ctypes
import mmap
import threading
import time

import pytest
import torch

import gpt2ffn.kernels.formats as F
from conftest import SMALL
from gpt2ffn import Config, quantize
from gpt2ffn.kernels.formats import HUGE_PAGE, on_huge_pages, packing_arena
from gpt2ffn.model import GPT2
from gpt2ffn.serving.engine import Engine, Loop, Request
from gpt2ffn.serving.kv_cache import KVCache, PagedKVCache
from gpt2ffn.serving.sampling import Sampling

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
                mp.setattr(F, "_placed", lambda nbytes: None)  # every tensor where torch puts it
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


def resident(t: torch.Tensor) -> float:
    """The fraction of t's pages in memory (mincore)."""
    start = t.data_ptr() // F.PAGE * F.PAGE
    n = -(-(t.data_ptr() + t.nbytes - start) // F.PAGE)
    vec = (ctypes.c_ubyte * n)()
    assert ctypes.CDLL(None).mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * F.PAGE), vec) == 0
    return sum(v & 1 for v in vec) / n


def test_make_resident_faults_every_page_in_and_keeps_what_they_hold():
    z = F.huge_zeros(((4 << 20) // 4,))  # a fresh mapping: nothing resident until written
    assert resident(z) == 0
    z[:1000] = 1.5
    if not F.make_resident(z):
        pytest.skip("no MADV_POPULATE_WRITE (Linux before 5.14)")
    assert resident(z) == 1 and bool(z[:1000].eq(1.5).all()) and not z[1000:].any()


def test_an_idle_server_loop_makes_the_kv_cache_resident():
    """The engine thread, with no request to run, faults the cache in a piece at a time (Loop.cold), block 0 of
    every layer first; a request then runs as it would have."""
    cfg = Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, vocab_size=96, bos_token_id=0, eos_token_id=0)
    model = GPT2(cfg).eval()
    engine = Engine(model, max_batch=16)  # 16 sequences of 1024 positions: 4 MiB per layer's k or v
    pools = engine.cache.k + engine.cache.v
    assert all(t.nbytes >= 4 << 20 and resident(t) == 0 for t in pools)
    if not F.make_resident(engine.cache.k[0][:1]):
        pytest.skip("no MADV_POPULATE_WRITE (Linux before 5.14)")
    loop = Loop(engine)
    try:
        deadline = time.monotonic() + 30
        while loop.cold is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.cold is None and all(resident(t) == 1 and not t.any() for t in pools)
        done = threading.Event()
        request = Request([1, 2, 3], Sampling(max_new_tokens=5),
                          sink=lambda ev: done.set() if ev.finish_reason else None)
        loop.submit(request)
        assert done.wait(30) and request.output == Engine(model, max_batch=1).run(
            [Request([1, 2, 3], Sampling(max_new_tokens=5))])[0].output
    finally:
        loop.stop()
