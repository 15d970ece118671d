"""Tensor parallelism (gpt2ffn.parallel, serving/tp.py) on CPU with gloo: processes forked from a forkserver (a fresh
interpreter, as spawn gives), world size 2 and 4, tiny configs, each compared with one process's fp32 forward,
gradients and greedy tokens."""

import copy
import glob
import multiprocessing as mp
import os
import shutil
import tempfile

import pytest
import torch

from gpt2ffn import Config, FeedForward, quantize
from gpt2ffn.model import GPT2, random_weights_
from gpt2ffn.serving.kv_cache import KVCache

# n_head 4 and hidden 128 divide by 2 and 4; a vocabulary of 98 does not (uneven vocab-parallel shards).
CFG = Config(n_embd=32, n_layer=2, n_head=4, n_positions=32, vocab_size=98, bos_token_id=0, eos_token_id=0)
PROMPTS = [[5, 17, 3, 40, 2], [9, 1]]
NEW = 8
TIMEOUT = 60  # seconds: a refused world size must end every rank long before this


def ffn_case():
    torch.manual_seed(0)
    ffn = FeedForward(CFG).eval()  # no dropout: forward and gradients deterministic
    with torch.no_grad():  # GPT-2-like scales: outputs O(1), where fp32 sums in another order differ by ~1e-7
        for name, p in ffn.named_parameters():
            p.normal_(0, 0.1 if name.endswith("bias") else 1.5 / p.shape[0] ** 0.5)
    x = torch.randn(3, 5, CFG.n_embd)
    return ffn, x, torch.randn(3, 5, CFG.n_embd)


def ffn_grads(ffn, x, dy):
    x = x.clone().requires_grad_()
    y = ffn(x)
    (y * dy).sum().backward()
    full = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in ffn.named_parameters()}
    return y.detach(), x.grad, full


def excess(got, expected, tol):
    """max(|got - expected| - tol |expected|): <= tol means within atol = rtol = tol (the tolerance table's form)."""
    return float(((got - expected).abs() - tol * expected.abs()).max())


def refused(world):
    """A model whose n_head (3 or 6) this world size does not divide, though its hidden width 96 divides."""
    return Config(n_embd=24, n_layer=1, n_head=3 if world == 2 else 6, n_positions=16, vocab_size=64)


def worker(rank, world, store, queue, cfg=CFG):
    """One rank: every check's numbers (or the error) go back to the test through the queue."""
    import torch.distributed as dist

    from gpt2ffn import parallel
    from gpt2ffn.errors import Gpt2ffnError
    from gpt2ffn.generate import Sampling, engine_for, generate
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    out = {}
    try:
        try:  # refused before any collective: were one rank to go on, the collectives below would hang
            parallel.parallelize(random_weights_(GPT2(refused(world)), 0))
        except Gpt2ffnError as e:
            out["refused"] = str(e)
        # the FFN, forward and gradients (RecomputeGELU's backward on the shards)
        ffn, x, dy = ffn_case()
        y0, dx0, g0 = ffn_grads(ffn, x, dy)
        tp = parallel.parallelize(copy.deepcopy(ffn))
        y1, dx1, g1 = ffn_grads(tp, x, dy)
        out["ffn_y"] = excess(y1, y0, 1e-6)
        out["ffn_dx"] = excess(dx1, dx0, 1e-6)
        out["ffn_grads"] = max(excess(g1[n], g0[n], 1e-6) for n in g0)
        with torch.no_grad():  # negative control: one rank's partial sum, without the all-reduce
            w1, b1 = tp.c_fc.weight.to_local(), tp.c_fc.bias.to_local()
            part = tp.act(x @ w1 + b1) @ tp.c_proj.weight.to_local() + tp.c_proj.bias.to_local()
        out["ffn_partial"] = excess(part, y0, 1e-6)
        out["ffn_bytes"] = (parallel.local_bytes(tp.c_fc) + parallel.local_bytes(tp.c_proj) - 4 * cfg.n_embd,
                            parallel.local_bytes(ffn.c_fc) + parallel.local_bytes(ffn.c_proj) - 4 * cfg.n_embd)
        # the whole model, vocab-parallel and replicated lm_head
        ref = random_weights_(GPT2(cfg), 3).eval()
        ids = torch.tensor([[5, 17, 3, 40, 2, 60, 97, 11]])
        with torch.no_grad():
            logits0 = ref(ids)
        s = Sampling(max_new_tokens=NEW)
        tokens0 = generate(ref, PROMPTS, s)
        for vocab_parallel in (True, False):
            model = parallel.parallelize(copy.deepcopy(ref), vocab_parallel=vocab_parallel)
            with torch.no_grad():
                out[f"logits_{vocab_parallel}"] = excess(model(ids), logits0, 1e-5)
            if rank == 0:
                out[f"tokens_{vocab_parallel}"] = (generate(model, PROMPTS, s), tokens0)
            else:
                engine_for(model, PROMPTS, s).follow()
            attn = [m for b in model.transformer.h for m in (b.attn.c_attn, b.attn.c_proj)]
            attn0 = [m for b in ref.transformer.h for m in (b.attn.c_attn, b.attn.c_proj)]
            bias = 4 * cfg.n_embd * cfg.n_layer  # attn.c_proj's bias is replicated
            out[f"attn_bytes_{vocab_parallel}"] = (sum(map(parallel.local_bytes, attn)) - bias,
                                                   sum(map(parallel.local_bytes, attn0)) - bias)
            out[f"head_{vocab_parallel}"] = model.lm_head.weight is model.transformer.wte.weight
            with torch.no_grad():  # HF-style cached decode: a rank's cache holds its share of the heads
                cache = KVCache(model.kv_config, 1)
                model(ids[:, :5], cache)
                steps = torch.cat([model(ids[:, t:t + 1], cache) for t in range(5, ids.shape[1])], 1)
            out[f"kv_cache_{vocab_parallel}"] = excess(steps, logits0[:, 5:], 1e-5)
            saved = model.save_pretrained(f"{store}-saved-{vocab_parallel}")  # every rank gathers, rank 0 writes
            if rank == 0:
                from safetensors.torch import load_file
                got, want = load_file(str(saved / "model.safetensors")), ref.state_dict()
                want.pop("lm_head.weight")
                out[f"saved_{vocab_parallel}"] = (sorted(got) == sorted(want)
                                                  and all(torch.equal(got[k], want[k]) for k in want))
                back = GPT2.from_pretrained(saved).eval()
                with torch.no_grad():
                    out[f"saved_logits_{vocab_parallel}"] = excess(back(ids), logits0, 1e-5)
        # load(tp=world), as `--tp N` under torchrun loads (it imports gpt2ffn.parallel there): one process's logits
        from gpt2ffn.loading import load
        whole, sharded = load("random:tiny:0")[0], load("random:tiny:0", tp=world)[0]
        with torch.no_grad():
            out["load_tp"] = excess(sharded(ids), whole(ids), 1e-5)
        fc = sharded.transformer.h[0].mlp.c_fc, whole.transformer.h[0].mlp.c_fc
        out["load_tp_bytes"] = parallel.local_bytes(fc[0]) * world == parallel.local_bytes(fc[1])
        # a model packed for inference, its fp32 weights held once (load_model's default): its values come back
        held = parallel.parallelize(quantize(copy.deepcopy(ref), "fp32"))
        with torch.no_grad():
            out["held_once"] = excess(held(ids), logits0, 1e-5)
        # a request rank 0 refuses (too long) still releases the followers: the next generate lines up
        long = [[1] * (cfg.n_positions + 8)]
        if rank == 0:
            try:
                generate(held, long, s)
            except Gpt2ffnError as e:
                out["refused_long"] = str(e)
            out["tokens_after"] = (generate(held, PROMPTS, s), tokens0)
        else:
            engine_for(held, long, s).follow()
            engine_for(held, PROMPTS, s).follow()
    except Exception as e:  # the test reads the message
        out["error"] = f"{type(e).__name__}: {e}"
    queue.put((rank, out))
    if "error" not in out:
        dist.destroy_process_group()


def spawn(world):
    # Ranks forked from a forkserver that imported torch and gpt2ffn once: spawned, each rank imported them itself,
    # and 4 ranks on 2 cores took ~20 s to start. (This module cannot be preloaded: the server has not the tests'
    # sys.path; a rank imports it, cheaply, to find `worker`.)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch.distributed", "gpt2ffn.generate", "gpt2ffn.loading", "gpt2ffn.parallel"])
    queue = ctx.Queue()
    store = tempfile.mktemp(prefix="gpt2ffn-tp-")
    procs = [ctx.Process(target=worker, args=(r, world, store, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=TIMEOUT) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        if os.path.exists(store):
            os.unlink(store)
        for saved in glob.glob(store + "-saved-*"):
            shutil.rmtree(saved)
    return results


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return request.param, spawn(request.param)


def test_sharded_ffn_equals_one_process(ranks):
    world, results = ranks
    for rank, r in results.items():
        assert "error" not in r, r.get("error")
        assert r["ffn_y"] <= 1e-6 and r["ffn_dx"] <= 1e-6 and r["ffn_grads"] <= 1e-6, (rank, r)
        assert r["ffn_partial"] > 1e-2  # the comparison can fail: without the all-reduce it does


def test_each_rank_holds_a_1_over_n_share(ranks):
    world, results = ranks
    for r in results.values():
        local, full = r["ffn_bytes"]
        assert local * world == full
        for vp in (True, False):
            local, full = r[f"attn_bytes_{vp}"]
            assert local * world == full
            assert r[f"head_{vp}"]  # wte and lm_head stay one tied Parameter


def test_sharded_model_logits_and_greedy_tokens(ranks):
    """... and a cached decode through KVCache(model.kv_config, B) (once refused: the cache was checked against
    the whole model's heads, not the rank's)."""
    world, results = ranks
    for r in results.values():
        assert r["logits_True"] <= 1e-5 and r["logits_False"] <= 1e-5, r
        assert r["load_tp"] <= 1e-5 and r["load_tp_bytes"], r  # generate.load(..., tp=world): sharded, same logits
        assert r["kv_cache_True"] <= 1e-5 and r["kv_cache_False"] <= 1e-5, r
    for vp in (True, False):
        got, expected = results[0][f"tokens_{vp}"]
        assert got == expected and len(got[0]) == NEW


def test_sharded_model_saves_the_whole_checkpoint(ranks):
    """save_pretrained gathers the shards (c_attn's [d, 3, d] view back to HF's [d, 3d]); rank 0's file holds
    the unsharded model's tensors bit for bit, and the model read back from it computes its logits."""
    world, results = ranks
    assert "error" not in results[0], results[0]
    for vp in (True, False):
        assert results[0][f"saved_{vp}"] and results[0][f"saved_logits_{vp}"] <= 1e-5


def test_a_held_once_model_and_a_refused_request(ranks):
    """parallelize of a model whose fp32 weights are held once gets them back (it failed at the first forward:
    'NoneType' has no attribute 'stale'); a request rank 0 refuses releases the other ranks (they died of a gloo
    'Connection closed by peer'), and the next generate gives one process's tokens."""
    world, results = ranks
    for r in results.values():
        assert "error" not in r, r["error"]
        assert r["held_once"] <= 1e-5
    assert "exceeds the context" in results[0]["refused_long"]
    got, expected = results[0]["tokens_after"]
    assert got == expected


def test_world_size_not_dividing_heads_is_refused_not_hung(ranks):
    world, results = ranks   # queue.get(timeout=TIMEOUT) in spawn() proves that no rank hung
    heads = refused(world).n_head
    for r in results.values():
        assert r["refused"] == (f"tensor-parallel world size {world} does not divide n_head={heads}: each rank "
                                "needs whole heads (n_head / world)")


def test_refused_before_any_process_group():
    from gpt2ffn import parallel
    from gpt2ffn.errors import Gpt2ffnError
    with pytest.raises(Gpt2ffnError, match="world size 3 does not divide the FFN's hidden width 128"):
        parallel.check_world(CFG, 3, attention=False)
    with pytest.raises(Gpt2ffnError, match="launch with torchrun"):
        parallel.parallelize(FeedForward(CFG))


def test_ddp_example_loss_curve_equals_one_process(tmp_path):
    """examples/train_ddp.py under torchrun, 2 ranks (gloo): its loss curve equals one process's on the same
    global batches within fp32 tolerance, and the curve falls (a model that trains, not a constant)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "ddp.json"
    env = dict(os.environ, PYTHONPATH=str(root / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(root / "examples" / "train_ddp.py"), "--steps", "6", "--compare", "--out", str(out)],
                   check=True, timeout=TIMEOUT * 2, env=env, capture_output=True)
    r = json.loads(out.read_text())
    assert r["world"] == 2 and len(r["losses"]) == len(r["single"]) == 6
    for a, b in zip(r["losses"], r["single"]):
        assert abs(a - b) <= 1e-5 + 1e-5 * abs(b), (r["losses"], r["single"])
    assert r["losses"][-1] < r["losses"][0] - 0.1
    assert r["single"] != r["half_batch"]  # negative control: one rank's half batch alone trains differently
    assert max(abs(a - b) for a, b in zip(r["single"], r["half_batch"])) > 1e-3


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_tp_without_torchrun_says_how(command, capsys, monkeypatch):
    from gpt2ffn.cli import main
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = [command, "--tp", "2", "--model", "random:tiny"] + (["Hi"] if command == "generate" else [])
    assert main(argv) == 2
    assert capsys.readouterr().err == ("error: --tp 2 runs one process per rank: start it with torchrun, e.g. "
                                       f"torchrun --nproc-per-node 2 -m gpt2ffn.cli {command} --tp 2 ... "
                                       "(WORLD_SIZE is not set)\n")
