"""The engine in a process of its own (vLLM's EngineCore), and what loads a model and builds its engine.

In one process the server's event loop (HTTP, routing, JSON, each stream's events) and its engine thread (the
steps, sampling, detokenizing) take turns on one interpreter lock: on an H200 host at 256 streaming clients the sum
of the two bounded the rate (README, "Devices"). With `serve --engine-process on` the engine runs in a child
process (`python -m gpt2ffn.serving.core FD...`) that loads the model and runs the same Loop; each API process
(one, or N with `--api-servers N`, all on the one port) loads only the tokenizer and holds an EngineProcess, which
offers the routes what Loop and Engine offer them in one process: submit, abort, counts, cut, stop.

Each API process has a channel of its own to the engine: a socket pair (multiprocessing.connection, pickled
messages; the API process reads it on its event loop, the engine sends a step's Tokens in one message).
  API -> engine: ("attached",) once, then ("add", [(rid, prompt, Sampling, arrival)]), ("abort", rid),
                 ("count", status, n), ("cut", message), ("metrics", n), ("stop",)
  engine -> API: ("ready", info) or ("failed", message), once; ("serving",) once every API process is attached;
                 ("added", rid, refusal or None) for each add; ("tokens", [(rid, id, logprob, top, text,
                 finish_reason, gap, prompt_logprobs)], (running, waiting, blocks)) after each step that has Tokens
                 for it or moved the counts; ("metrics", n, text); then the channel's end when it exits
The engine decides each add as Engine.add does (400 for bad input, 503 beyond --max-waiting), since it alone sees
what every API process has sent: one round trip a request, before its response starts. Requests by HTTP status are
counted in the engine's registry too, so /metrics from any API process tells the whole server. The engine process
ignores SIGINT and SIGTERM: shutdown is the API processes' to drive (cut, stop), as with --tp's followers; it ends
once every one has stopped or gone (a SIGKILLed server's channel ends, and so does the process).
"""

import asyncio
import gc
import itertools
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from multiprocessing.connection import Connection, wait
from pathlib import Path

from ..errors import Gpt2ffnError, warning_line
from ..loading import load
from .engine import Loop, QueueFull, Request, Token, TooMany, name_os_thread
from .metrics import Metrics
from .tp import make_engine


def check_max_len(max_model_len, context: int):
    """--max-model-len within the model's context (serve checks it before binding where it can read the config)."""
    if max_model_len is not None and not 0 < max_model_len <= context:
        raise Gpt2ffnError(f"--max-model-len {max_model_len} is outside [1, {context}], the model's context "
                           "(n_positions)")


def build(p: dict, metrics) -> tuple:
    """(model, tokenizer, name, engine, max_len, max_batch) from the Service's settings `p` (Service.settings):
    the model loaded, its engine made. Where the engine runs: the server's process, or the engine process."""
    if p["threads"]:
        import torch
        torch.set_num_threads(p["threads"])
    model, tok, name = load(p["model_spec"], p["dtype"], p["precision"], p["device"], p["tp"], p["activations"],
                            p["kv_dtype"], need_tokenizer=not p["skip_tokenizer"])
    if p["skip_tokenizer"]:
        tok = None
    check_max_len(p["max_model_len"], model.config.n_positions)
    max_len = p["max_model_len"] or model.config.n_positions
    max_batch = p["max_batch"] or 64  # a 64-client load never waits
    engine = make_engine(model, tok.decode if tok is not None else None, max_batch=max_batch,
                         max_waiting=p["max_waiting"], max_len=max_len, batch_invariant=p["batch_invariant"],
                         metrics=metrics, kv_fraction=p["kv_fraction"], graph_seconds=p["graph_seconds"],
                         cuda_graphs=p["cuda_graphs"])
    if p["freeze_heap"]:
        # What start-up made (torch's, the tokenizer's and the model's objects: ~240k with GPT-2 medium) lives
        # as long as the process. Frozen out of the cyclic collector's sight, as vLLM does after its warm-up
        # (freeze_gc_heap), a full collection no longer walks it: 70-99 ms each on an Intel Xeon, 2 threads,
        # a pause in every stream, against ~0 after the freeze. Only for a server's process: frozen objects are
        # never collected, which a process that loads models again and again (the tests) would feel.
        gc.collect()
        gc.freeze()
    return model, tok, name, engine, max_len, max_batch


def describe(p: dict, loaded: str, names: list, engine, dtype, max_batch: int, max_len: int, tok) -> list:
    """The lines `serve` prints once the model is in: what was loaded where, the limits, the CUDA graphs."""
    cache = engine.cache
    served = f" (served as {', '.join(map(repr, names))})" if p["served_names"] else ""
    where = " in its own process" if p.get("engine_process") else ""
    if p.get("api_servers", 1) > 1:
        where += f", {p['api_servers']} API processes"
    if p.get("precision") in ("bf16", "int8", "int4"):  # the embeddings stay float32: say what the layers hold
        dtype = f"{p['precision']} weights"
    lines = [f"gpt2ffn: {loaded}{served} loaded on {engine.device}{where} ({dtype}), ready (max batch {max_batch}, "
             f"max waiting {p['max_waiting']}, KV cache {cache.num_blocks * cache.block_size} positions, max model "
             f"len {max_len}, max n {p['max_n']}{', batch-invariant' if p['batch_invariant'] else ''}"
             f"{', no tokenizer: token ids in and out' if tok is None else ''})"]
    if engine.graph_capture is not None:
        (done, shapes, seconds), static = engine.graph_capture, engine.static
        failed = static.capture_error and f"; a capture failed, that shape runs eagerly: {static.capture_error}"
        lines.append(f"gpt2ffn: decode steps captured as {done} of {shapes} CUDA graphs in {seconds:.1f} s "
                     f"(batch buckets {static.buckets}, spans {static.spans}; the rest on first use{failed or ''})")
    return lines


class EngineGone(Gpt2ffnError):
    """The engine process has exited: nothing more can be served."""


def child_env() -> dict:
    """This environment, for a child process that imports the gpt2ffn this one runs, whatever its sys.path."""
    here = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}


def start_engine(settings: dict, channels: int = 1) -> tuple:
    """Start the engine process for `settings` (Service.settings) with `channels` channels, one per API process:
    (its Popen, the server's end of each channel)."""
    pairs = [socket.socketpair() for _ in range(channels)]
    fds = [theirs.fileno() for _, theirs in pairs]
    proc = subprocess.Popen([sys.executable, "-m", "gpt2ffn.serving.core", *map(str, fds)], pass_fds=fds,
                            env=child_env())
    conns = []
    for mine, theirs in pairs:
        theirs.close()
        conns.append(Connection(mine.detach()))
    conns[0].send(settings)
    return proc, conns


class EngineProcess:
    """An API process's side of the engine process: sends it requests, and hands each Token that comes back to its
    request's sink on the event loop (the channel is a reader of that loop: no thread, no lock). proc: the engine
    process where this API process started it (else another did: --api-servers)."""

    def __init__(self, conn: Connection, proc=None):
        self.conn, self.proc = conn, proc
        self.requests = {}           # rid -> Request, sent and not yet finished
        self.ids = itertools.count()
        self.held = (0, 0, 0)        # the engine's last (running, waiting, KV blocks in use)
        self.waiters = {}            # ("added", rid) of an add, ("metrics", n) of a /metrics ask -> its future
        self.loop, self.gone, self.serving = None, None, None
        self.halted = False          # stopped before it was attached (a signal while the model loaded)
        self.patience = 30.0         # seconds stop() waits for the engine process to end before killing it
        self.stopping = False        # stop() asked it to end: its channel's end is no death
        self.died = None             # called with why on the loop when the engine process ends unasked
        self.uncounted = {}          # status -> requests answered before attach (the engine reads no channel then)

    def exited(self) -> str:
        code = self.proc.wait() if self.proc is not None else None
        return "the engine process exited" + (f" (code {code})" if code is not None else "")

    def wait_ready(self) -> dict:
        """Block (the loader thread) until the engine has loaded: its info, or a Gpt2ffnError with its error."""
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            raise Gpt2ffnError(f"{self.exited()} before the model was loaded") from None
        if kind == "failed":
            raise Gpt2ffnError(payload)
        return payload

    def attach(self, loop, then):
        """From any thread: read the channel on `loop` from now on; call then() there once every API process has
        (the engine says "serving"): /health is 200 from one of them only when any of them would answer."""
        def on_loop():
            self.loop, self.serving = loop, then
            loop.add_reader(self.conn.fileno(), self.readable)
            self.send(("attached",))
            self.send_uncounted()
        loop.call_soon_threadsafe(on_loop)

    # -- what the routes call (on the event loop) ----------------------------------------------------------
    async def submit(self, *requests: Request):
        """Queue requests (all or none), as Engine.add: Gpt2ffnError on bad input, QueueFull beyond max_waiting,
        decided by the engine (it alone knows what every API process has sent): one round trip a request."""
        if self.gone:
            raise EngineGone(self.gone)
        items = []
        for r in requests:
            r.id = next(self.ids)
            self.requests[r.id] = r
            items.append((r.id, r.prompt, r.params, r.arrival))
        key = ("added", requests[0].id)
        self.waiters[key] = added = self.loop.create_future()
        self.send(("add", items))
        try:
            refused = await added
        finally:
            self.waiters.pop(key, None)
        if refused is not None:
            for r in requests:
                self.requests.pop(r.id, None)
            kind, message = refused
            raise REFUSALS.get(kind, RuntimeError)(message)

    def abort(self, request: Request):
        if request.finish_reason is None and not request.cancelled and not self.gone:
            request.cancelled = True
            self.send(("abort", request.id))

    def counts(self) -> tuple:
        return self.held

    def cut(self, message: str):
        if not self.gone:
            self.send(("cut", message))

    def count(self, code: str):
        """One answered request, by HTTP status: counted in the engine process's registry (gpt2ffn_requests), the
        one every API process reports. Before attach (the model loading) held here: the engine reads no channel
        then, and a flood of refusals would fill the socket and block this process's event loop."""
        if self.gone:
            return
        if self.loop is None:
            self.uncounted[code] = self.uncounted.get(code, 0) + 1
        else:
            self.send(("count", code, 1))

    def send_uncounted(self):
        for code, n in self.uncounted.items():
            self.send(("count", code, n))
        self.uncounted.clear()

    async def exposition(self) -> bytes | None:
        """The engine's Prometheus metrics (its registry's text); None if it is gone or does not answer in 5 s."""
        if self.gone:
            return None
        n = next(self.ids)
        self.waiters["metrics", n] = waiter = asyncio.get_running_loop().create_future()
        self.send(("metrics", n))
        try:
            return await asyncio.wait_for(waiter, 5)
        except asyncio.TimeoutError:
            return None
        finally:
            self.waiters.pop(("metrics", n), None)

    def stop(self):
        """Let the engine finish what runs (Tokens still handed over); it ends once every API process has
        stopped (the process this one started is killed after `patience` seconds: 30, as Loop.stop gives its
        thread, or with --api-servers as long as the others may drain). Before the channel is attached (a signal
        while the model loads) nothing runs: the engine process this one started is ended at once, and the
        loader thread, which reads the channel until then, sees it end (load_or_exit then exits quietly)."""
        self.stopping = True
        if self.loop is None:
            self.halted = True
            if self.proc is not None:
                self.proc.kill()
                self.proc.wait()
            else:  # another API process's engine serves on: what this one refused still counts there
                self.send_uncounted()
                self.send(("stop",))
            return
        if not self.gone:
            self.send(("stop",))
        deadline = time.monotonic() + self.patience
        while not self.gone and time.monotonic() < deadline:
            if self.conn.poll(0.05):
                self.readable()  # Tokens still coming, then the end of the channel (gone)
        if self.proc is not None:
            try:
                self.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.close("the engine process was stopped")

    # -- the channel -----------------------------------------------------------------------------------------
    def send(self, message):
        try:
            self.conn.send(message)
        except OSError:
            self.close(self.exited())

    def readable(self):
        try:
            while not self.gone and self.conn.poll():
                self.handle(self.conn.recv())
        except (EOFError, OSError):
            self.close(self.exited())

    def handle(self, message):
        kind = message[0]
        if kind == "tokens":
            _, items, self.held = message
            for rid, token, logprob, top, text, finish, gap, prompt_lp in items:
                r = self.requests.get(rid)
                if r is None:
                    continue
                if prompt_lp is not None:
                    r.prompt_logprobs = prompt_lp
                if finish is not None:
                    r.finish_reason = finish
                    del self.requests[rid]
                if r.sink is not None:
                    r.sink(Token(r, token, logprob, top, text, finish, gap))
        elif kind == "serving":
            self.serving()
        elif kind in ("added", "metrics"):  # an add's answer (None or its refusal), a /metrics text
            waiter = self.waiters.get((kind, message[1]))
            if waiter is not None and not waiter.done():
                waiter.set_result(message[2])

    def close(self, why: str):
        """The engine is gone (or stopped): what was in flight ends with an error Token carrying why."""
        if self.gone:
            return
        self.gone = why
        if self.loop is not None and not self.loop.is_closed():
            self.loop.remove_reader(self.conn.fileno())
        self.conn.close()
        victims, self.requests = list(self.requests.values()), {}
        for r in victims:
            r.finish_reason = "error"
            if r.sink is not None:
                r.sink(Token(r, -1, text=why, finish_reason="error"))
        for key, waiter in self.waiters.items():
            if not waiter.done():
                waiter.set_result(None if key[0] == "metrics" else ("gone", why))
        if not self.stopping and self.died is not None:
            self.died(why)


REFUSALS = {"QueueFull": QueueFull, "TooMany": TooMany, "Gpt2ffnError": Gpt2ffnError,  # else a bug: RuntimeError
            "gone": EngineGone}


class Counted:
    """A server's gpt2ffn_requests with the engine in its own process: Metrics.requests' labels(code).inc(),
    counted there (EngineProcess.count)."""

    def __init__(self, engine: EngineProcess):
        self.engine = engine

    def labels(self, code: str):
        return _Count(self.engine, code)


class _Count:
    def __init__(self, engine, code):
        self.engine, self.code = engine, code

    def inc(self):
        self.engine.count(self.code)


# -- the engine process ----------------------------------------------------------------------------------------
class Channel:
    """The engine process's end of one API process's channel. What it sends is pickled by the sender and written by
    a thread of the channel's own: an API process that stops reading (stalled, stopped with SIGSTOP) holds up its
    own messages, never the engine's steps or the other API processes."""

    def __init__(self, fd: int):
        self.conn, self.open = Connection(fd), True
        self.told = None        # the counts last sent
        self.attached = False   # its API process reads the channel and has its tokenizer: it can serve
        self.broken = False     # its API process is gone: what is sent is dropped
        self.queue = queue.SimpleQueue()
        self.writer = threading.Thread(target=self.write, name="gpt2ffn-send", daemon=True)
        self.writer.start()

    def send(self, message):
        if not self.broken:
            self.queue.put(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))

    def write(self):
        while (data := self.queue.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:  # that API process is gone: its requests are aborted where its channel ends (main)
                self.broken = True

    def flush(self, timeout: float = 5):
        """Send what is queued, then end the writer."""
        self.queue.put(None)
        self.writer.join(timeout)


def main(fds: list):
    name_os_thread("gpt2ffn-core")
    for sig in (signal.SIGINT, signal.SIGTERM):  # the server's to act on (a terminal's Ctrl-C reaches both)
        signal.signal(sig, signal.SIG_IGN)
    warnings.showwarning = warning_line  # loading's warnings (fit_vocab) on one line, as the CLI prints them
    # The server's death (even a SIGKILL) closes its end of the channel: recv() below then ends this process.
    # (Not PR_SET_PDEATHSIG: that fires when the thread that started the process ends, the server's loader thread.)
    channels = [Channel(fd) for fd in fds]
    settings = channels[0].conn.recv()

    def everyone(message):
        for ch in channels:
            ch.send(message)

    metrics = Metrics()  # the engine's, and the requests by status every API process reports (Counted)
    # Loaded in a thread that ends, as the server's loader thread does in one process: loaded in this (lasting)
    # thread, the engine thread's steps took 1.11x the time (GPT-2 124M fp32, one stream, 2 threads, Intel Xeon:
    # 18.0 against 16.2 ms a token), this thread's OpenMP pool staying beside the engine thread's.
    built = []
    loader = threading.Thread(target=lambda: built.append(attempt(build, settings, metrics)), name="gpt2ffn-loader")
    loader.start()
    loader.join()
    if isinstance(built[0], Exception):
        everyone(("failed", str(built[0]) or type(built[0]).__name__))
        for ch in channels:
            ch.flush()
        return
    model, tok, name, engine, max_len, max_batch = built[0]
    live = {}  # (channel, rid) -> [Request, whether its prompt log-probs went out]

    def deliver(events: list):  # the Loop thread, after each step
        out = {}
        for ev in events:
            r = ev.request
            ch, rid = r.id
            entry = live.get(r.id)
            prompt_lp = None
            if entry is not None and r.params.prompt_logprobs and not entry[1]:
                prompt_lp, entry[1] = r.prompt_logprobs, True
            out.setdefault(ch, []).append((rid, ev.id, ev.logprob, ev.top, ev.text, ev.finish_reason, ev.gap,
                                           prompt_lp))
            if ev.finish_reason is not None:
                live.pop(r.id, None)
        counts = engine.counts()
        for i, ch in enumerate(channels):
            if i in out or (ch.open and counts != ch.told):
                ch.told = counts
                ch.send(("tokens", out.get(i, []), counts))

    loop = Loop(engine, deliver)
    dtype = model.transformer.wte.weight.dtype
    everyone(("ready", {"name": name, "config": model.config, "max_len": max_len, "max_batch": max_batch,
                        "lines": describe(settings, name, settings["served_names"] or [name], engine, dtype,
                                          max_batch, max_len, tok)}))
    conns = {ch.conn: i for i, ch in enumerate(channels)}
    serving = False
    while any(ch.open for ch in channels):
        for conn in wait([ch.conn for ch in channels if ch.open]):
            i = conns[conn]
            try:
                message = conn.recv()
            except (EOFError, OSError):  # that API process has gone without a stop: its requests go too
                channels[i].open = False
                for key, (r, _) in list(live.items()):
                    if key[0] == i:
                        engine.abort(r)
            else:
                serve_message(i, message, channels[i], engine, loop, live, metrics)
            still = [ch for ch in channels if ch.open]
            if not serving and still and all(ch.attached for ch in still):
                serving = True  # every API process can answer: each says so (/health 200) from now on
                everyone(("serving",))
    loop.stop()
    for ch in channels:  # what is queued goes out; then the process ends, and with it each channel
        ch.flush()


def serve_message(i: int, message, ch: Channel, engine, loop: Loop, live: dict, metrics):
    """One message from API process i's channel."""
    kind = message[0]
    if kind == "add":
        requests = [Request(prompt, params, id=(i, rid), arrival=arrival)
                    for rid, prompt, params, arrival in message[1]]
        for r in requests:
            live[r.id] = [r, False]
        try:
            loop.submit(*requests)
        except Exception as e:  # QueueFull (a 503) or bad input (a 400), as in one process; else a bug (a 500)
            for r in requests:
                live.pop(r.id, None)
            ch.send(("added", message[1][0][0], (type(e).__name__, str(e))))
            return
        ch.send(("added", message[1][0][0], None))
    elif kind == "abort":
        entry = live.get((i, message[1]))
        if entry is not None:
            engine.abort(entry[0])
    elif kind == "count":
        metrics.requests.labels(message[1]).inc(message[2])
    elif kind == "cut":
        loop.cut(message[1])
    elif kind == "metrics":
        metrics.counts(engine)
        ch.send(("metrics", message[1], metrics.render()))
    elif kind == "attached":
        ch.attached = True
    elif kind == "stop":
        ch.open = False


def attempt(f, *args):
    """f(*args), or the exception it raised."""
    try:
        return f(*args)
    except Exception as e:
        return e


if __name__ == "__main__":
    main([int(fd) for fd in sys.argv[1:]])
