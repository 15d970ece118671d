"""`gpt2ffn serve`: OpenAI-compatible completions over gpt2ffn's GPT-2 (FastAPI + uvicorn).

One worker thread owns the model; requests wait in a bounded queue in front of it (full: 503 with
Retry-After), so the event loop never runs the model. A client that disconnects cancels its generation at
the next token. SIGTERM (uvicorn's graceful shutdown) stops accepting, lets in-flight requests finish, exits.
Every error is a 4xx/5xx JSON body in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

import asyncio
import contextlib
import json
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .errors import Gpt2ffnError
from .generate import Sampling, TextStream, stream

MAX_BODY = 1 << 20  # 1 MiB: a GPT-2 context is 1024 tokens, a few KiB of text


class CompletionRequest(BaseModel):
    """The subset of OpenAI's /v1/completions that GPT-2 can honour; other fields are refused by name."""

    model_config = ConfigDict(extra="forbid")
    model: str
    prompt: str | list[str] = Field(description="a prompt, or a list of prompts (one choice each)")
    max_tokens: int = Field(16, ge=1, le=1024)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(1, ge=1, le=1, description="one choice per prompt")
    user: str | None = None


def error(status: int, message: str, param=None, code=None, kind="invalid_request_error", headers=None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class Metrics:
    """Prometheus text exposition, by hand: a few counters, a gauge and a latency histogram."""

    BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = {}  # status code -> count
        self.prompt_tokens = self.completion_tokens = self.cancelled = 0
        self.latency_sum, self.latency_count = 0.0, 0
        self.latency_buckets = [0] * len(self.BUCKETS)

    def observe(self, status: int, seconds: float = None):
        with self.lock:
            self.requests[status] = self.requests.get(status, 0) + 1
            if seconds is not None:
                self.latency_sum += seconds
                self.latency_count += 1
                for i, b in enumerate(self.BUCKETS):
                    self.latency_buckets[i] += seconds <= b

    def add_tokens(self, prompt: int, completion: int):
        with self.lock:
            self.prompt_tokens += prompt
            self.completion_tokens += completion

    def render(self, queue_depth: int) -> str:
        with self.lock:
            lines = ["# HELP gpt2ffn_requests_total Completion requests by HTTP status.",
                     "# TYPE gpt2ffn_requests_total counter"]
            lines += [f'gpt2ffn_requests_total{{code="{c}"}} {n}' for c, n in sorted(self.requests.items())]
            lines += ["# HELP gpt2ffn_prompt_tokens_total Prompt tokens processed.",
                      "# TYPE gpt2ffn_prompt_tokens_total counter", f"gpt2ffn_prompt_tokens_total {self.prompt_tokens}",
                      "# HELP gpt2ffn_completion_tokens_total Tokens generated.",
                      "# TYPE gpt2ffn_completion_tokens_total counter",
                      f"gpt2ffn_completion_tokens_total {self.completion_tokens}",
                      "# HELP gpt2ffn_cancelled_total Generations stopped because the client went away.",
                      "# TYPE gpt2ffn_cancelled_total counter", f"gpt2ffn_cancelled_total {self.cancelled}",
                      "# HELP gpt2ffn_queue_depth Requests waiting or running.",
                      "# TYPE gpt2ffn_queue_depth gauge", f"gpt2ffn_queue_depth {queue_depth}",
                      "# HELP gpt2ffn_request_latency_seconds Time from request to last token.",
                      "# TYPE gpt2ffn_request_latency_seconds histogram"]
            lines += [f'gpt2ffn_request_latency_seconds_bucket{{le="{b}"}} {n}'
                      for b, n in zip(self.BUCKETS, self.latency_buckets)]
            lines += [f'gpt2ffn_request_latency_seconds_bucket{{le="+Inf"}} {self.latency_count}',
                      f"gpt2ffn_request_latency_seconds_sum {self.latency_sum}",
                      f"gpt2ffn_request_latency_seconds_count {self.latency_count}"]
        return "\n".join(lines) + "\n"


@dataclass
class Job:
    prompts: list          # token ids per prompt
    sampling: Sampling
    stop: list
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)

    def emit(self, event):
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


class Engine:
    """The model, its tokenizer, and the one worker thread that runs them."""

    def __init__(self, model_spec, max_queue=16):
        self.model_spec, self.max_queue = model_spec, max_queue
        self.model = self.tok = None
        self.name = None
        self.jobs = queue.Queue(maxsize=max_queue)
        self.busy = 0
        self.ready = threading.Event()
        self.metrics = Metrics()
        self.thread = None

    def load(self):
        from .generate import load
        self.model, self.tok, self.name = load(self.model_spec)
        self.thread = threading.Thread(target=self.work, name="gpt2ffn-worker", daemon=True)
        self.thread.start()
        self.ready.set()

    def load_or_exit(self):
        """load(), and on a bad model spec say so in one line and end the process with exit code 2."""
        try:
            self.load()
            print(f"gpt2ffn: {self.name} loaded, ready", flush=True)
        except Exception as e:
            import os
            print(f"error: {e}", file=sys.stderr, flush=True)
            os._exit(2)

    def depth(self) -> int:
        return self.jobs.qsize() + self.busy

    def submit(self, job: Job) -> bool:
        try:
            self.jobs.put_nowait(job)
            return True
        except queue.Full:
            return False

    def work(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            self.busy = 1
            try:
                self.run(job)
            except Exception as e:  # a bug must reach the client as a 500, not kill the worker
                job.emit(("error", f"{type(e).__name__}: {e}"))
            finally:
                self.busy = 0

    def run(self, job: Job):
        import torch
        streams = [TextStream(self.tok.decode, job.stop) for _ in job.prompts]
        finish = ["length"] * len(job.prompts)
        counts = [0] * len(job.prompts)
        if job.cancel.is_set():
            return job.emit(("cancelled", None))
        with torch.inference_mode():
            for step in stream(self.model, job.prompts, job.sampling):
                if job.cancel.is_set():
                    with self.metrics.lock:
                        self.metrics.cancelled += 1
                    return job.emit(("cancelled", None))
                for i, t in enumerate(step):
                    if t is None or finish[i] == "stop":
                        continue
                    counts[i] += 1
                    if t == job.sampling.eos_token_id:
                        finish[i] = "stop"
                        continue
                    delta, stopped = streams[i].push(t)
                    if stopped:
                        finish[i] = "stop"
                    if delta:
                        job.emit(("delta", (i, delta)))
                if all(f == "stop" for f in finish):
                    break
        for i, s in enumerate(streams):
            rest = s.finish()
            if rest:
                job.emit(("delta", (i, rest)))
        job.emit(("done", (finish, counts)))


def create_app(engine: Engine, max_body: int = MAX_BODY) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        # Bind first, load in the background: /health answers 503 until the weights are in.
        loader = threading.Thread(target=engine.load_or_exit, name="gpt2ffn-loader", daemon=True)
        loader.start()
        yield
        engine.jobs.put(None)  # after uvicorn has drained in-flight requests: stop the worker

    app = FastAPI(title="gpt2ffn", version=__import__("gpt2ffn").__version__, lifespan=lifespan,
                  description="OpenAI-compatible completions over gpt2ffn's GPT-2.")

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body):
            return error(413, f"request body of {length} bytes exceeds the limit of {max_body} bytes",
                         code="request_too_large")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        engine.metrics.observe(400)
        first = exc.errors()[0]
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        return error(400, f"{'.'.join(where) + ': ' if where else ''}{message}", param=".".join(where) or None)

    @app.get("/health")
    async def health():
        if not engine.ready.is_set():
            return error(503, "loading the model", kind="unavailable")
        return {"status": "ok", "model": engine.name, "queue_depth": engine.depth()}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return engine.metrics.render(engine.depth())

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": 0,
                                            "owned_by": "gpt2ffn"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        t0 = time.perf_counter()
        if not engine.ready.is_set():
            return error(503, "the model is still loading", kind="unavailable", headers={"Retry-After": "5"})
        if body.model != engine.name:
            engine.metrics.observe(404)
            return error(404, f"model {body.model!r} does not exist; this server has {engine.name!r}",
                         param="model", code="model_not_found")
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not prompts or len(prompts) > 16:
            engine.metrics.observe(400)
            return error(400, "prompt must be a string or a list of 1 to 16 strings", param="prompt")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            engine.metrics.observe(400)
            return error(400, "stop must be up to 4 non-empty strings", param="stop")
        cfg = engine.model.config
        ids = [engine.tok.encode(p) or [cfg.eos_token_id] for p in prompts]  # empty prompt: start of text
        longest = max(len(i) for i in ids)
        if longest + body.max_tokens > cfg.n_positions:
            engine.metrics.observe(400)
            return error(400, f"prompt ({longest} tokens) + max_tokens ({body.max_tokens}) exceeds the model's "
                              f"context of {cfg.n_positions} tokens", param="max_tokens",
                         code="context_length_exceeded")
        if any(max(i) >= cfg.vocab_size for i in ids):
            engine.metrics.observe(400)
            return error(400, "the prompt encodes to tokens outside this model's vocabulary", param="prompt")
        try:
            sampling = Sampling(max_new_tokens=body.max_tokens, temperature=body.temperature,
                                top_p=body.top_p if body.top_p < 1 else None, seed=body.seed,
                                eos_token_id=cfg.eos_token_id)
        except Gpt2ffnError as e:
            engine.metrics.observe(400)
            return error(400, str(e))
        job = Job(ids, sampling, stop, asyncio.get_running_loop())
        if not engine.submit(job):
            engine.metrics.observe(503)
            return error(503, f"the server is busy ({engine.max_queue} requests queued); retry shortly",
                         kind="server_busy", headers={"Retry-After": "1"})
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        usage_prompt = sum(len(i) for i in ids)

        def chunk(choices, usage=None):
            return {"id": cid, "object": "text_completion", "created": created, "model": engine.name,
                    "choices": choices, **({"usage": usage} if usage else {})}

        def usage(counts):
            engine.metrics.add_tokens(usage_prompt, sum(counts))
            return {"prompt_tokens": usage_prompt, "completion_tokens": sum(counts),
                    "total_tokens": usage_prompt + sum(counts)}

        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))

            async def events():
                status = 200
                try:
                    while True:
                        kind, data = await job.events.get()
                        if kind == "delta":
                            i, text = data
                            yield f"data: {json.dumps(chunk([{'index': i, 'text': text, 'logprobs': None, 'finish_reason': None}]))}\n\n"
                        elif kind == "done":
                            finish, counts = data
                            yield "data: " + json.dumps(chunk([{"index": i, "text": "", "logprobs": None,
                                                                "finish_reason": f} for i, f in enumerate(finish)])) + "\n\n"
                            u = usage(counts)
                            if include_usage:
                                yield f"data: {json.dumps(chunk([], u))}\n\n"
                            yield "data: [DONE]\n\n"
                            return
                        elif kind == "error":
                            status = 500
                            yield f"data: {json.dumps({'error': {'message': data, 'type': 'server_error'}})}\n\n"
                            return
                        else:
                            return
                finally:
                    job.cancel.set()  # a client that went away stops its generation
                    engine.metrics.observe(status, time.perf_counter() - t0)

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        texts = [""] * len(ids)
        while True:
            try:
                kind, data = await asyncio.wait_for(job.events.get(), timeout=0.25)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel.set()
                    engine.metrics.observe(499)
                    return error(499, "client closed the request")
                continue
            if kind == "delta":
                texts[data[0]] += data[1]
            elif kind == "done":
                finish, counts = data
                engine.metrics.observe(200, time.perf_counter() - t0)
                return chunk([{"index": i, "text": t, "logprobs": None, "finish_reason": f}
                              for i, (t, f) in enumerate(zip(texts, finish))], usage(counts))
            elif kind == "error":
                engine.metrics.observe(500)
                return error(500, f"generation failed: {data}", kind="server_error")
            else:
                engine.metrics.observe(499)
                return error(499, "client closed the request")

    return app


def serve(model_spec, host="127.0.0.1", port=8000, max_queue=16):
    """Load the model, then serve until SIGTERM / Ctrl-C (in-flight requests finish first)."""
    import uvicorn
    from pathlib import Path
    if model_spec and not model_spec.startswith("random:") and not Path(model_spec).is_dir():
        raise Gpt2ffnError(f"model {model_spec!r} is neither a checkpoint directory nor random:<preset>[:seed]")
    engine = Engine(model_spec, max_queue)
    app = create_app(engine)
    print(f"gpt2ffn: serving {model_spec or 'openai-community/gpt2'} on http://{host}:{port} "
          "(OpenAPI: /docs, /openapi.json)", flush=True)
    # uvicorn drains, restores the handlers it found, then re-raises SIGTERM: let that end the process with 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=60)
