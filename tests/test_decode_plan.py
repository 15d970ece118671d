"""A decode step as one native call (kernels/packed.DecodePlan over gpt2ffn._C.StepPlan): embeddings read from
the packed lm_head as Packed.weights reads them, logits equal to the step run op by op, and a plan that follows
every change to the weights or routes it was built from."""

import copy
import dataclasses
import json

import pytest
import torch

from conftest import SMALL, native_isas, randomize_
from gpt2ffn import quantize
from gpt2ffn.errors import ConfigError, Gpt2ffnError
from gpt2ffn.kernels import packed as kp
from gpt2ffn.kernels.formats import Packed
from gpt2ffn.model import GPT2
from gpt2ffn.serving.kv_cache import KVCache
from gpt2ffn.tolerances import tolerance

pytestmark = pytest.mark.skipif(kp.WHY_NOT_NATIVE is not None, reason=f"no native kernels: {kp.WHY_NOT_NATIVE}")

FORMATS = [("fp32", "fp32"), ("bf16", "fp32"), ("int8", "fp32"), ("int4", "fp32"), ("int8", "int8"), ("int4", "int8")]


@pytest.mark.parametrize("precision,activations", FORMATS)
def test_packed_rows_are_the_packed_weights(precision, activations):
    w = torch.randn(64, 200, generator=torch.Generator().manual_seed(0))  # 200 outputs: a padded last super-block
    p = Packed(w, None, precision, activations=activations)
    ids = torch.tensor([0, 1, 63, 64, 130, 199, 5, 5])
    rows = kp._C.packed_rows(ids, p.w, p.scale if p.scale is not None else torch.empty(0), p.format, p.K, p.N,
                             p.group)
    assert torch.equal(rows, p.weights(ids))
    other = torch.tensor([1, 0, 63, 64, 130, 199, 5, 5])
    assert not torch.equal(kp._C.packed_rows(other, p.w, p.scale if p.scale is not None else torch.empty(0),
                                             p.format, p.K, p.N, p.group), p.weights(ids))  # negative control


def test_packed_rows_refuses_an_id_or_a_k_outside_the_layer():
    p = Packed(torch.randn(64, 100), None, "int8")
    with pytest.raises(RuntimeError, match=r"id 100 outside \[0, 100\)"):
        kp._C.packed_rows(torch.tensor([100]), p.w, p.scale, p.format, p.K, p.N, p.group)
    with pytest.raises(RuntimeError, match="not 2 super-blocks of K=128"):  # a K the weights do not hold
        kp._C.packed_rows(torch.tensor([1]), p.w, p.scale, p.format, 128, p.N, p.group)


def model_at(precision, keep_fp32=False, seed=0, cfg=SMALL):
    m = randomize_(GPT2(cfg), seed).eval().requires_grad_(False)  # no gradient asked: the fused step may run
    m = quantize(m, precision, keep_fp32=keep_fp32)
    if keep_fp32:  # the probe may time torch's addmm faster on these tiny layers; the fused step is native's
        for mod in m.modules():
            if getattr(mod, "packed", None) is not None:
                mod.packed.route = {"decode": "native", "prefill": "native"}
    return m


def steps(m, ids, fused: bool, kv=torch.float32):
    """Logits of each new token of ids (1, T) after the first, one cached step at a time (a cache of dtype kv)."""
    out = []
    cache = KVCache(m.config, 1, kv)
    with torch.no_grad():
        m(ids[:, :4], cache)
        for t in range(4, ids.shape[1]):
            mask = None if fused else torch.ones(1, t + 1, dtype=torch.long)  # a mask: the op-by-op route
            out.append(m(ids[:, t:t + 1], cache, mask)[:, -1])
    return torch.cat(out)


@pytest.mark.parametrize("keep_fp32", [False, True], ids=["held-once", "keep-fp32"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "int4"])
def test_one_call_step_equals_the_step_op_by_op(precision, keep_fp32):
    m = model_at(precision, keep_fp32)
    assert m.fused_decode()
    ids = torch.randint(0, SMALL.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    fused, plain = steps(m, ids, True), steps(m, ids, False)
    tol = tolerance(torch.float32)
    torch.testing.assert_close(fused, plain, atol=tol.atol, rtol=tol.rtol)
    other = model_at(precision, keep_fp32, seed=1)  # negative control: another model's steps differ
    assert not torch.allclose(steps(other, ids, True), plain, atol=tol.atol, rtol=tol.rtol)


def test_the_plan_follows_weights_changed_in_place():
    m = model_at("fp32", keep_fp32=True)
    ids = torch.randint(0, SMALL.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    before = steps(m, ids, True)
    with torch.no_grad():
        m.transformer.h[1].mlp.c_fc.weight.mul_(1.5)      # the packed copy is stale now
        m.transformer.ln_f.weight.add_(0.25)
        m.transformer.wpe.weight[5:].mul_(-1.0)
    plan = m.__dict__["_plan"]
    assert not plan.valid()
    after, plain = steps(m, ids, True), steps(m, ids, False)
    assert m.__dict__["_plan"] is not plan and m.__dict__["_plan"].valid()  # rebuilt, and the step ran fused
    assert not torch.allclose(after, before)
    tol = tolerance(torch.float32)
    torch.testing.assert_close(after, plain, atol=tol.atol, rtol=tol.rtol)


def test_the_plan_follows_routes_and_training():
    m = model_at("int8")
    assert m.fused_decode()
    plan = m.__dict__["_plan"]
    m.transformer.h[0].attn.c_proj.packed.route = {"decode": "torch", "prefill": "torch"}
    assert not plan.valid() and not m.fused_decode()  # one layer off the native route: no fused step
    m.transformer.h[0].attn.c_proj.packed.route = {"decode": "native", "prefill": "native"}
    assert m.fused_decode() and m.__dict__["_plan"] is not plan
    m.lm_head.packed.route = {"decode": "torch", "prefill": "torch"}
    assert not m.fused_decode()  # the lm_head is part of the step
    fp32 = model_at("fp32")
    assert fp32.fused_decode()
    fp32.train()
    assert not fp32.fused_decode()
    fp32.eval()  # re-packs: a new plan
    assert fp32.fused_decode()


def test_a_plan_refuses_caches_that_do_not_fit():
    m = model_at("int8")
    assert m.fused_decode()
    plan = m.__dict__["_plan"]
    cache = KVCache(m.config, 1)
    ids, pos, slots = torch.tensor([3]), torch.tensor([0]), torch.tensor([0])
    with pytest.raises(RuntimeError, match="one k and one v cache per layer: 3"):
        plan.run(ids, pos, slots, cache.k[:2], cache.v[:2])
    with pytest.raises(RuntimeError, match=r"position 32 outside \[0, 32\)"):
        plan.run(ids, torch.tensor([32]), slots, cache.k, cache.v)
    with pytest.raises(RuntimeError, match=r"id 96 outside \[0, 96\)"):
        plan.run(torch.tensor([96]), pos, slots, cache.k, cache.v)


@pytest.mark.parametrize("isa", native_isas())
@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_every_build_and_activation_steps_as_op_by_op(isa, activation):
    cfg = dataclasses.replace(SMALL, activation_function=activation)  # exact GELU: applied after the kernels
    old = kp._C.set_isa(isa)
    try:
        for precision, kv in (("fp32", torch.float32), ("int4", torch.float32), ("int4", torch.float16)):
            m = model_at(precision, cfg=cfg)
            ids = torch.randint(0, SMALL.vocab_size, (1, 10), generator=torch.Generator().manual_seed(3))
            tol = tolerance(torch.float32)
            torch.testing.assert_close(steps(m, ids, True, kv), steps(m, ids, False, kv), atol=tol.atol,
                                       rtol=tol.rtol)
    finally:
        kp._C.set_isa(old)


@pytest.mark.parametrize("precision,kv", [("fp32", torch.float32), ("int8", torch.float32), ("int8", torch.float16)])
def test_rows_of_a_step_are_each_row_alone_whatever_the_threads(precision, kv):
    """Rows at different positions in different slots (the serving engine's decode): each row's logits are
    bitwise those of the row stepped alone, with 1 thread or 2 (no sum crosses rows or depends on the split)."""
    m = model_at(precision)
    assert m.fused_decode()
    plan = m.__dict__["_plan"]
    cache = KVCache(m.config, 3, kv)
    g = torch.Generator().manual_seed(4)
    for k in cache.k + cache.v:
        k.copy_(torch.randn(k.shape, generator=g))
    ids, pos, slots = torch.tensor([5, 17, 90]), torch.tensor([3, 20, 9]), torch.tensor([2, 0, 1])
    threads = torch.get_num_threads()
    try:
        out = {}
        for n in (1, 2):
            torch.set_num_threads(n)
            out[n] = plan.run(ids, pos, slots, cache.k, cache.v)
            alone = torch.cat([plan.run(ids[i:i + 1], pos[i:i + 1], slots[i:i + 1], cache.k, cache.v)
                               for i in range(3)])
            assert torch.equal(out[n], alone)
        assert torch.equal(out[1], out[2])
    finally:
        torch.set_num_threads(threads)


def test_strided_or_int32_ids_and_shared_slots():
    """A batch stepped column by column (ids[:, t:t + 1] of a (B, T) tensor is strided), int32 ids, a deep copy
    after a fused step; two rows in one slot are refused."""
    m = model_at("int8")
    ids = torch.randint(0, SMALL.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5))
    out = {}
    for name, x in (("strided", ids), ("int32", ids.int()), ("contiguous", None)):
        cache = KVCache(m.config, 2)
        with torch.no_grad():
            m(ids[:, :5], cache)
            rows = []
            for t in range(5, 8):
                step = ids[:, t:t + 1].contiguous() if x is None else x[:, t:t + 1]
                rows.append(m(step, cache)[:, -1])
        out[name] = torch.cat(rows)
    assert torch.equal(out["strided"], out["contiguous"]) and torch.equal(out["int32"], out["contiguous"])
    twin = copy.deepcopy(m)
    assert "_plan" not in twin.__dict__ and twin.fused_decode()
    plan, cache = m.__dict__["_plan"], KVCache(m.config, 2)
    with pytest.raises(RuntimeError, match="two rows share a cache slot"):
        plan.run(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([1, 1]), cache.k, cache.v)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "int4"])
def test_an_fp16_cache_steps_as_op_by_op_on_the_same_cache(precision):
    """An fp16 KV cache (GPT2.kv_dtype's default for bf16/int8/int4): the one-call step writes each new key and
    value rounded to nearest even, as the op-by-op step's copy into the cache does, and reads them widened:
    the same logits and the same cache; against an fp32 cache they differ (the cache's dtype is what is read)."""
    m = model_at(precision)
    ids = torch.randint(0, SMALL.vocab_size, (1, 12), generator=torch.Generator().manual_seed(6))
    tol = tolerance(torch.float32)
    fused, plain = steps(m, ids, True, torch.float16), steps(m, ids, False, torch.float16)
    torch.testing.assert_close(fused, plain, atol=tol.atol, rtol=tol.rtol)
    wide = steps(m, ids, True, torch.float32)
    scale = wide.abs().max()
    # negative control: the fp16 cache moves the logits 10x more than the two routes differ (measured: 60x-40000x)
    assert (fused - wide).abs().max() > 10 * (fused - plain).abs().max()
    if precision in ("fp32", "bf16"):  # float activations: by about fp16's rounding of the keys (1e-5 measured)
        assert (fused - wide).abs().max() < 1e-4 * scale
    caches = {}
    for fused_step in (True, False):  # what the step wrote: the keys and values rounded once, the same bits
        cache = KVCache(m.config, 1, torch.float16)
        with torch.no_grad():
            m(ids[:, :4], cache)
            m(ids[:, 4:5], cache, None if fused_step else torch.ones(1, 5, dtype=torch.long))
        caches[fused_step] = [t[:, :, 4] for t in cache.k + cache.v]
    for a, b in zip(caches[True], caches[False]):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-3, rtol=1e-3)  # one fp16 ulp of the same key


def test_kv_dtype_defaults_and_choice():
    assert model_at("fp32").kv_dtype == torch.float32  # HF's cache values: fp32 stays exact against HF
    for precision in ("bf16", "int8", "int4"):
        assert model_at(precision).kv_dtype == torch.float16
    assert model_at("int8", keep_fp32=True).kv_dtype == torch.float16
    assert randomize_(GPT2(SMALL), 0).kv_dtype == torch.float32  # not packed: plain torch modules
    m = model_at("int8")
    m.kv_dtype = torch.float32
    assert m.kv_dtype == torch.float32
    m.kv_dtype = None
    assert m.kv_dtype == torch.float16
    for bad in (torch.int8, torch.bfloat16, "float16"):
        with pytest.raises(ConfigError, match="kv_dtype must be torch.float32 or torch.float16"):
            m.kv_dtype = bad
    twin = copy.deepcopy(m)
    twin.kv_dtype = torch.float32
    assert m.kv_dtype == torch.float16  # per model


def test_a_plan_refuses_caches_of_mixed_or_other_dtypes():
    m = model_at("int8")
    assert m.fused_decode()
    plan = m.__dict__["_plan"]
    ids, pos, slots = torch.tensor([3]), torch.tensor([0]), torch.tensor([0])
    half, full = KVCache(m.config, 1, torch.float16), KVCache(m.config, 1)
    with pytest.raises(RuntimeError, match="layer 0: k and v caches must be contiguous Half"):
        plan.run(ids, pos, slots, half.k, full.v)
    bf = [torch.zeros_like(t, dtype=torch.bfloat16) for t in (full.k[0], full.v[0])]  # the plan's own check
    with pytest.raises(RuntimeError, match="k and v caches must be float32 or float16, got BFloat16"):
        plan.run(ids, pos, slots, [bf[0]] * len(full.k), [bf[1]] * len(full.v))
    with pytest.raises(Gpt2ffnError, match="KVCache dtype must be torch.float32 or torch.float16"):
        KVCache(m.config, 1, torch.bfloat16)  # refused when made (it failed at the first decode step)


@pytest.mark.parametrize("isa", native_isas())
@pytest.mark.parametrize("precision,activations", FORMATS)
def test_decode_prefetch_changes_no_bit(isa, precision, activations):
    """Decode's rows equal bit for bit with and without prefetching (the tiles that prefetch: 1 and 2 rows of the
    float formats, 1 row of the integer ones)."""
    g = torch.Generator().manual_seed(5)
    w, b, x = torch.randn(256, 200, generator=g), torch.randn(200, generator=g), torch.randn(2, 256, generator=g)
    p = Packed(w, b, precision, activations=activations)
    old_isa, old = kp._C.set_isa(isa), kp._C.set_prefetch(p.format)
    try:
        outs = []
        for distance in (0, 8192):
            assert kp._C.set_prefetch(p.format, distance) in (old, 0, 8192)
            outs.append([kp._C.linear(x[:M], p.w, p.scale, p.bias, p.format, p.N, p.group) for M in (1, 2)])
        assert kp._C.set_prefetch(p.format) == 8192  # the distance was in effect
    finally:
        kp._C.set_prefetch(p.format, old)
        kp._C.set_isa(old_isa)
    for a, v in zip(*outs):
        assert torch.equal(a, v)


def test_set_prefetch_refuses_what_it_cannot_be():
    with pytest.raises(RuntimeError, match="unknown format 9"):
        kp._C.set_prefetch(9, 0)
    with pytest.raises(RuntimeError, match="past any cache"):
        kp._C.set_prefetch(0, 1 << 30)


def test_prefetch_is_timed_cached_and_can_be_forced(tmp_path, monkeypatch):
    monkeypatch.setenv("GPT2FFN_CACHE", str(tmp_path))
    monkeypatch.delenv("GPT2FFN_PREFETCH", raising=False)
    old = [kp._C.set_prefetch(f) for f in range(6)]
    try:
        m = model_at("int8")
        fmts = {mod.packed.format for mod in m.modules() if getattr(mod, "packed", None) is not None}
        entry = next(v for k, v in json.loads((tmp_path / "routes.json").read_text()).items()
                     if k.endswith("|prefetch"))
        assert set(entry["ms"]) == {str(d) for d in kp.PREFETCH}
        assert {kp._C.set_prefetch(f) for f in fmts} == {int(min(entry["ms"], key=entry["ms"].get))}
        monkeypatch.setenv("GPT2FFN_PREFETCH", "4096")
        model_at("int8")
        assert {kp._C.set_prefetch(f) for f in fmts} == {4096}
        monkeypatch.setenv("GPT2FFN_PREFETCH", "-1")
        with pytest.raises(ConfigError, match="GPT2FFN_PREFETCH=-1"):
            model_at("int8")
    finally:
        for f, v in enumerate(old):
            kp._C.set_prefetch(f, v)


def prefill_both(m, ids, kv, past_ids=None):
    """(native, op by op): the last position's logits of ids (B, T) through GPT2.forward with a cache (after
    past_ids, if given), and the caches written."""
    out = []
    for native in (True, False):
        cache = KVCache(m.config, ids.shape[0], kv)
        with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
            if not native:
                mp.setattr(m, "fused_decode", lambda: False)
            if past_ids is not None:
                m(past_ids, cache, last_only=True)
            out.append((m(ids, cache, last_only=True), cache))
    return out


@pytest.mark.parametrize("isa", native_isas())
@pytest.mark.parametrize("kv", [torch.float32, torch.float16], ids=["fp32-cache", "fp16-cache"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8", "int4"])
def test_prefill_in_one_call_equals_the_prefill_op_by_op(isa, kv, precision):
    """A prompt (and a second chunk after it) through StepPlan.prefill: the last logits and every cached key and
    value as the op-by-op forward computes them, for two rows at once; another model's differ. The routes differ
    in LayerNorm's float rounding only, which an fp16 cache can round apart by one fp16 step (~1e-3) and int8
    activations by one quantization step of a group (int8, int4): those are compared at 1e-3."""
    m = model_at(precision)
    g = torch.Generator().manual_seed(3)
    first, ids = torch.randint(0, SMALL.vocab_size, (2, 7), generator=g), torch.randint(0, 96, (2, 9), generator=g)
    f32 = tolerance(torch.float32)
    loose = precision in ("int8", "int4") or kv == torch.float16
    atol, rtol = (1e-3, 1e-3) if loose else (f32.atol, f32.rtol)
    old = kp._C.set_isa(isa)
    try:
        for past_ids in (None, first):
            (native, cn), (plain, cp) = prefill_both(m, ids, kv, past_ids)
            assert native.shape == plain.shape == (2, 1, SMALL.vocab_size) and cn.length == cp.length
            torch.testing.assert_close(native, plain, atol=atol, rtol=rtol)
            for a, b in zip(cn.k + cn.v, cp.k + cp.v):
                torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)
        (other, _), _ = prefill_both(model_at(precision, seed=1), ids, kv)
        assert not torch.allclose(other, plain, atol=atol, rtol=rtol)
    finally:
        kp._C.set_isa(old)


@pytest.mark.parametrize("isa", native_isas())
@pytest.mark.parametrize("precision,activations", FORMATS)
def test_chunks_of_several_prompts_in_one_call_are_each_alone_bitwise(isa, precision, activations):
    """GPT2.prefill_slots (StepPlan.prefill_many): chunks of three sequences in one call, one a second chunk after
    a cached one, 20 rows in all (a block of 16 on AMX tiles where the CPU has them); each chunk's logits and
    every key and value bitwise as that chunk through prefill_slot alone. Bad chunk lists are refused."""
    m = quantize(randomize_(GPT2(SMALL), 0).eval().requires_grad_(False), precision, activations=activations)
    g = torch.Generator().manual_seed(5)
    head = torch.randint(0, 96, (7,), generator=g)
    chunks = [(torch.randint(0, 96, (n,), generator=g), past, slot) for n, past, slot in ((5, 0, 0), (11, 0, 2),
                                                                                          (4, 7, 1))]
    old = kp._C.set_isa(isa)
    try:
        with torch.no_grad():
            alone, together = KVCache(m.config, 3, m.kv_dtype), KVCache(m.config, 3, m.kv_dtype)
            for cache in (alone, together):
                m.prefill_slot(head, 0, cache.k, cache.v, 1)
            one = torch.cat([m.prefill_slot(ids, past, alone.k, alone.v, slot) for ids, past, slot in chunks])
            many = m.prefill_slots(torch.cat([c[0] for c in chunks]), [c[1] for c in chunks],
                                   [c[2] for c in chunks], [len(c[0]) for c in chunks], together.k, together.v)
            assert many.shape == (3, SMALL.vocab_size) and torch.equal(many, one)
            for a, b in zip(alone.k + alone.v, together.k + together.v):
                assert torch.equal(a, b)
            ids = torch.cat([c[0] for c in chunks])
            with pytest.raises(RuntimeError, match="two chunks share a cache slot"):
                m.prefill_slots(ids, [0, 0, 7], [0, 1, 1], [5, 11, 4], together.k, together.v)
            with pytest.raises(RuntimeError, match="add up to 19, not the 20 ids"):
                m.prefill_slots(ids, [0, 0, 7], [0, 2, 1], [5, 10, 4], together.k, together.v)
            with pytest.raises(RuntimeError, match=r"chunk 1: length 0"):
                m.prefill_slots(ids, [0, 0, 7], [0, 2, 1], [5, 0, 15], together.k, together.v)
    finally:
        kp._C.set_isa(old)


def test_prefill_refuses_what_does_not_fit():
    m = model_at("int8")
    cache = KVCache(m.config, 1, m.kv_dtype)
    plan = m.__dict__["_plan"] if m.fused_decode() else None
    with pytest.raises(RuntimeError, match="non-empty 1-D integer tensor"):
        plan.prefill(torch.tensor([], dtype=torch.long), 0, 0, cache.k, cache.v)
    with pytest.raises(RuntimeError, match=rf"position {SMALL.n_positions} outside \[0, {SMALL.n_positions}\)"):
        plan.prefill(torch.tensor([1, 2, 3]), SMALL.n_positions - 2, 0, cache.k, cache.v)
    short = KVCache(m.config, 1, m.kv_dtype, max_len=4)
    with pytest.raises(RuntimeError, match=r"position 4 outside the cache \(1, 4\)"):
        plan.prefill(torch.tensor([1, 2, 3]), 2, 0, short.k, short.v)
    with pytest.raises(RuntimeError, match=r"slot 1 position 0 outside the cache"):
        plan.prefill(torch.tensor([1, 2]), 0, 1, cache.k, cache.v)


@pytest.mark.parametrize("isa", native_isas())
@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_long_prefill_after_a_cached_prompt_on_every_build(isa, precision):
    """40 tokens after 30 cached (70 keys: two 64-key blocks of the attention's scratch; 40 rows: blocks of 16 on
    AMX tiles where the CPU has them, and 8 more) through StepPlan.prefill, as the op by op forward."""
    cfg = dataclasses.replace(SMALL, n_positions=128, n_layer=2)
    m = model_at(precision, cfg=cfg)
    g = torch.Generator().manual_seed(4)
    first, ids = torch.randint(0, 96, (1, 30), generator=g), torch.randint(0, 96, (1, 40), generator=g)
    old = kp._C.set_isa(isa)
    try:
        (native, cn), (plain, cp) = prefill_both(m, ids, m.kv_dtype, first)
        (other, _), _ = prefill_both(model_at(precision, seed=1, cfg=cfg), ids, m.kv_dtype, first)
    finally:
        kp._C.set_isa(old)
    torch.testing.assert_close(native, plain, atol=1e-3, rtol=1e-3)
    for a, b in zip(cn.k + cn.v, cp.k + cp.v):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-3, rtol=1e-3)
    assert not torch.allclose(other, plain, atol=1e-3, rtol=1e-3)
