"""`gpt2ffn serve`: OpenAI-compatible completions over gpt2ffn's GPT-2 (FastAPI + uvicorn).

A thin HTTP layer over the continuous-batching engine (serving/engine.py): it validates, tokenizes, hands
requests to the engine's thread and turns its Tokens into JSON or server-sent events. The event loop never
runs the model. Beyond --max-batch running and --max-waiting queued requests: 503 with Retry-After. A client
that disconnects frees its slot at the next step. SIGTERM (uvicorn's graceful shutdown) stops accepting,
lets in-flight requests finish, exits. Every error is JSON in OpenAI's shape:
{"error": {"message", "type", "param", "code"}}, naming the field at fault.
"""

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .errors import Gpt2ffnError
from .serving.engine import Engine, Loop, QueueFull
from .serving.engine import Request as EngineRequest
from .serving.metrics import Metrics
from .serving.sampling import Sampling

MAX_BODY = 1 << 20  # 1 MiB: a GPT-2 context is 1024 tokens, a few KiB of text
MAX_CHOICES = 128   # prompts x n in one request


class SamplingFields(BaseModel):
    """What completions and chat share: OpenAI's sampling fields and the common extras of vLLM and
    llama-server. Other fields are refused by name."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(None, ge=0, le=4096)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 or 0: off (vLLM, llama-server)")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(1, ge=1, le=16)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=4096)
    cache_prompt: bool | None = Field(None, description="llama-server's; accepted (there is no prompt cache)")
    user: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="a string, a list of strings, a list of token ids, or a list of token-id lists")
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str
    name: str | None = None


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=4096)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    prompt: str | None = None
    content: str | None = None  # llama-server's name


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    tokens: list[int]


class BadRequest(Exception):
    def __init__(self, message, param=None, status=400, code=None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error(status: int, message: str, param=None, code=None, kind="invalid_request_error", headers=None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class Service:
    """The model, its tokenizer, the engine and the thread that steps it."""

    def __init__(self, model_spec, max_batch=None, max_waiting=256, batch_invariant=False, precision="fp32",
                 chat_template=None, threads=None):
        self.model_spec, self.max_batch, self.max_waiting = model_spec, max_batch, max_waiting
        self.threads = threads
        self.batch_invariant, self.precision = batch_invariant, precision
        self.template = None
        if chat_template:
            import jinja2.sandbox
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self.template = env.from_string(open(chat_template).read())
        self.model = self.tok = self.name = self.engine = self.loop = None
        self.ready = threading.Event()
        self.metrics = Metrics()

    def load(self):
        from .generate import load
        if self.threads:
            import torch
            torch.set_num_threads(self.threads)
        self.model, self.tok, self.name = load(self.model_spec, precision=self.precision)
        self.max_batch = self.max_batch or 64  # a 64-client load never waits
        self.engine = Engine(self.model, self.tok.decode, max_batch=self.max_batch, max_waiting=self.max_waiting,
                             batch_invariant=self.batch_invariant, metrics=self.metrics)
        self.loop = Loop(self.engine)
        self.ready.set()

    def load_or_exit(self):
        """load(), and on a bad model spec say so in one line and end the process with exit code 2."""
        try:
            self.load()
            print(f"gpt2ffn: {self.name} loaded, ready (max batch {self.max_batch}, max waiting "
                  f"{self.max_waiting}{', batch-invariant' if self.batch_invariant else ''})", flush=True)
        except Exception as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            os._exit(2)

    # -- from a request body to engine requests --------------------------------------------------------------
    def prompts(self, prompt) -> list:
        """OpenAI's four prompt shapes -> a list of token-id lists."""
        cfg = self.model.config
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise BadRequest("prompt must not be an empty list", "prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        out = []
        for p in prompt:
            ids = (self.tok.encode(p) or [cfg.eos_token_id]) if isinstance(p, str) else list(p)
            if not ids:
                raise BadRequest("prompt: a token-id list must not be empty", "prompt")
            if min(ids) < 0 or max(ids) >= cfg.vocab_size:
                raise BadRequest(f"prompt has token ids outside this model's vocabulary [0, {cfg.vocab_size})",
                                 "prompt")
            out.append(ids)
        return out

    def sampling(self, body: SamplingFields, prompts: list, max_tokens: int, logprobs=None, echo=False) -> list:
        """One Sampling per choice (prompt-major, n per prompt); choice j of n gets seed + j."""
        cfg = self.model.config
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise BadRequest("stop must be up to 4 non-empty strings", "stop")
        if len(prompts) * body.n > MAX_CHOICES:
            raise BadRequest(f"{len(prompts)} prompts x n={body.n} exceed {MAX_CHOICES} choices per request", "n")
        if max_tokens == 0 and not echo:
            raise BadRequest("max_tokens 0 needs echo: true (the prompt's own log-probs)", "max_tokens")
        if body.min_tokens > max_tokens:
            raise BadRequest(f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
        bias = {}
        for key, value in (body.logit_bias or {}).items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < cfg.vocab_size:
                raise BadRequest(f"logit_bias: key {key!r} is not a token id in [0, {cfg.vocab_size})", "logit_bias")
            if not -100 <= value <= 100:
                raise BadRequest(f"logit_bias: value {value} for token {key} is outside [-100, 100]", "logit_bias")
            bias[int(key)] = value
        longest = max(len(p) for p in prompts)
        if longest + max_tokens > cfg.n_positions:
            raise BadRequest(f"prompt ({longest} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                             f"of {cfg.n_positions} tokens", "max_tokens", code="context_length_exceeded")
        return [Sampling(max_new_tokens=max_tokens, temperature=body.temperature,
                         top_k=body.top_k if body.top_k > 0 else None, top_p=body.top_p if body.top_p < 1 else None,
                         seed=None if body.seed is None else body.seed + j, eos_token_id=cfg.eos_token_id, stop=stop,
                         presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                         repetition_penalty=body.repetition_penalty, logit_bias=bias, min_tokens=body.min_tokens,
                         ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=echo and logprobs is not None)
                for _ in prompts for j in range(body.n)]

    def logprobs(self, ids: list, lps: list, tops: list) -> dict:
        """OpenAI's legacy logprobs object: tokens, token_logprobs, top_logprobs (the top ones and the chosen
        token), text_offset (of each token in the choice's text)."""
        d = self.tok.decode
        offsets = [len(d(ids[:i])) for i in range(len(ids))]
        tops_out = []
        for t, lp, top in zip(ids, lps, tops):
            if lp is None:
                tops_out.append(None)
                continue
            entry = {}
            for i, v in [*zip(*top), (t, lp)]:  # two ids may decode alike: the likelier keeps the key
                entry.setdefault(d([i]), v)
            tops_out.append(entry)
        return {"tokens": [d([t]) for t in ids], "token_logprobs": list(lps), "top_logprobs": tops_out,
                "text_offset": offsets}


def create_app(svc: Service, max_body: int = MAX_BODY) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        # Bind first, load in the background: /health answers 503 until the weights are in.
        threading.Thread(target=svc.load_or_exit, name="gpt2ffn-loader", daemon=True).start()
        yield
        if svc.loop is not None:  # after uvicorn has drained in-flight requests: stop the engine thread
            svc.loop.stop()

    app = FastAPI(title="gpt2ffn", version=__import__("gpt2ffn").__version__, lifespan=lifespan,
                  description="OpenAI-compatible completions over gpt2ffn's GPT-2, continuously batched.")

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body):
            return error(413, f"request body of {length} bytes exceeds the limit of {max_body} bytes",
                         code="request_too_large")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        svc.metrics.requests.labels("400").inc()
        first = exc.errors()[0]
        where = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message = "the request body is not valid JSON"
        return error(400, f"{'.'.join(where) + ': ' if where else ''}{message}", param=".".join(where) or None)

    def refuse(status, message, **kw):
        svc.metrics.requests.labels(str(status)).inc()
        return error(status, message, **kw)

    @app.get("/health")
    async def health():
        if not svc.ready.is_set():
            return error(503, "loading the model", kind="unavailable")
        running, waiting, _ = svc.engine.counts()
        return {"status": "ok", "model": svc.name, "running": running, "waiting": waiting}

    @app.get("/metrics")
    async def metrics():
        if svc.engine is not None:
            svc.metrics.counts(svc.engine)
        return Response(svc.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": svc.name, "object": "model", "created": 0, "owned_by": "gpt2ffn",
                                            "max_model_len": svc.model.config.n_positions if svc.model else None}]}

    def unready(body_model):
        if not svc.ready.is_set():
            return error(503, "the model is still loading", kind="unavailable", headers={"Retry-After": "5"})
        if body_model != svc.name:
            return refuse(404, f"model {body_model!r} does not exist; this server has {svc.name!r}",
                          param="model", code="model_not_found")
        return None

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        text = body.prompt if body.prompt is not None else body.content
        if text is None or not svc.ready.is_set():
            return refuse(400, "prompt: a string to tokenize is required", param="prompt")
        ids = svc.tok.encode(text)
        return {"tokens": ids, "count": len(ids), "max_model_len": svc.model.config.n_positions}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        V = svc.model.config.vocab_size
        if any(not 0 <= t < V for t in body.tokens):
            return refuse(400, f"tokens: ids must be in [0, {V})", param="tokens")
        text = svc.tok.decode(body.tokens)
        return {"prompt": text, "content": text}

    def submit(prompts: list, samplings: list):
        """One engine request per choice, queued: (requests, their event queue), or an error response (503
        beyond --max-waiting), before any byte of the answer is sent."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        reqs = []
        for c, s in enumerate(samplings):
            def sink(ev, c=c):
                loop.call_soon_threadsafe(events.put_nowait, (c, ev))
            reqs.append(EngineRequest(prompts[c // (len(samplings) // len(prompts))], s, sink))
        try:
            svc.loop.submit(*reqs)
        except QueueFull as e:
            return refuse(503, f"the server is busy ({e}); retry shortly", kind="server_busy",
                          headers={"Retry-After": "1"})
        except Gpt2ffnError as e:
            return refuse(400, str(e), param="prompt")
        svc.metrics.counts(svc.engine)
        return reqs, events

    async def run(request: Request, reqs: list, events, on_event):
        """Feed (choice, Token) to on_event until every request finishes. Returns None, or an error response
        (499 when the client left, 500 when the engine failed)."""
        left = len(reqs)
        try:
            while left:
                try:
                    c, ev = await asyncio.wait_for(events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return refuse(499, "client closed the request")
                    continue
                if ev.finish_reason == "error":
                    return refuse(500, f"generation failed: {ev.text}", kind="server_error")
                left -= ev.finish_reason is not None
                await on_event(c, ev)
        finally:
            for r in reqs:
                if r.finish_reason is None:
                    svc.engine.abort(r)
        return None

    def complete(body, prompts, samplings, echo_text, chat=False):
        """Non-streaming or streaming response for either endpoint."""
        cid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        n_choices = len(samplings)
        per_prompt = n_choices // len(prompts)
        usage_prompt = sum(len(prompts[c // per_prompt]) for c in range(n_choices))
        texts = [echo_text[c // per_prompt] if echo_text else "" for c in range(n_choices)]
        gen = [[] for _ in range(n_choices)]          # generated ids
        shown = [[] for _ in range(n_choices)]        # ids in the logprobs object: (echoed prompt +) generated
        lps = [[] for _ in range(n_choices)]
        tops = [[] for _ in range(n_choices)]
        finish = [None] * n_choices
        started = [False] * n_choices
        want_lp = not chat and body.logprobs is not None
        obj = "chat.completion" if chat else "text_completion"

        def usage():
            done = sum(len(i) for i in gen)
            return {"prompt_tokens": usage_prompt, "completion_tokens": done, "total_tokens": usage_prompt + done}

        def choice(c, text, logprobs=None, reason=None):
            if chat:
                return {"index": c, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
            return {"index": c, "text": text, "logprobs": logprobs, "finish_reason": reason}

        def head(obj_name, choices, u=None):
            return {"id": cid, "object": obj_name, "created": created, "model": svc.name, "choices": choices,
                    **({"usage": u} if u else {})}

        async def collect(c, ev):
            r = ev.request
            if not started[c]:
                started[c] = True
                if r.params.prompt_logprobs:  # echo: the prompt's own tokens and log-probs, first one null
                    shown[c] = list(r.prompt)
                    lps[c] = [lp for lp, _ in r.prompt_logprobs]
                    tops[c] = [top for _, top in r.prompt_logprobs]
            if ev.id >= 0:
                gen[c].append(ev.id)
                shown[c].append(ev.id)
                lps[c].append(ev.logprob)
                tops[c].append(ev.top)
                texts[c] += ev.text
            if ev.finish_reason:
                finish[c] = ev.finish_reason

        def logprobs_of_choice(c):
            return svc.logprobs(shown[c], lps[c], tops[c]) if want_lp else None

        if not body.stream:
            async def whole(request: Request):
                queued = submit(prompts, samplings)
                if not isinstance(queued, tuple):
                    return queued
                failed = await run(request, *queued, collect)
                if failed is not None:
                    return failed
                svc.metrics.requests.labels("200").inc()
                return head(obj, [choice(c, texts[c], logprobs_of_choice(c), finish[c]) for c in range(n_choices)],
                            usage())
            return whole

        include_usage = bool((body.stream_options or {}).get("include_usage"))
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def delta(c, text, reason=None, logprobs=None):
            if chat:
                return {"index": c, "delta": {"content": text} if text or not reason else {},
                        "finish_reason": reason}
            return {"index": c, "text": text, "logprobs": logprobs, "finish_reason": reason}

        async def streamed(request: Request):
            out = asyncio.Queue()
            queued = submit(prompts, samplings)
            if not isinstance(queued, tuple):
                return queued

            async def push(c, ev):
                first = not started[c]
                await collect(c, ev)
                text = ev.text
                if first and echo_text:
                    text = echo_text[c // per_prompt] + text
                lp = None
                if want_lp and ev.id >= 0:
                    lp = svc.logprobs([ev.id], [ev.logprob], [ev.top])
                if text or lp or ev.finish_reason:
                    await out.put(head(chunk_obj, [delta(c, text, ev.finish_reason, lp)]))

            async def events():
                task = asyncio.ensure_future(run(request, *queued, push))
                status = 200
                try:
                    if chat:
                        yield "data: " + json.dumps(head(chunk_obj, [{"index": c, "delta": {"role": "assistant"},
                                                                      "finish_reason": None}
                                                                     for c in range(n_choices)])) + "\n\n"
                    while not (task.done() and out.empty()):
                        try:
                            item = await asyncio.wait_for(out.get(), timeout=0.1)
                        except asyncio.TimeoutError:
                            continue
                        yield f"data: {json.dumps(item)}\n\n"
                    failed = task.result()
                    if failed is not None:
                        status = failed.status_code
                        yield f"data: {failed.body.decode()}\n\n"
                        return
                    if include_usage:
                        yield f"data: {json.dumps(head(chunk_obj, [], usage()))}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    task.cancel()  # a client that went away: run()'s finally aborts its requests
                    if status == 200:
                        svc.metrics.requests.labels("200").inc()

            return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return streamed

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        bad = unready(body.model)
        if bad is not None:
            return bad
        try:
            prompts = svc.prompts(body.prompt)
            samplings = svc.sampling(body, prompts, 16 if body.max_tokens is None else body.max_tokens,
                                     body.logprobs, body.echo)
        except BadRequest as e:
            return refuse(e.status, str(e), param=e.param, code=e.code)
        echo = [svc.tok.decode(p) for p in prompts] if body.echo else None
        return await complete(body, prompts, samplings, echo)(request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        if svc.template is None:
            return refuse(400, "GPT-2 has no chat template: use /v1/completions with a prompt (or start the "
                               "server with --chat-template FILE)", param="messages", code="no_chat_template")
        bad = unready(body.model)
        if bad is not None:
            return bad
        text = svc.template.render(messages=[m.model_dump() for m in body.messages], add_generation_prompt=True,
                                   bos_token="<|endoftext|>", eos_token="<|endoftext|>")
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, svc.model.config.n_positions - len(svc.tok.encode(text)))
        try:
            prompts = svc.prompts(text)
            samplings = svc.sampling(body, prompts, max_tokens)
        except BadRequest as e:
            return refuse(e.status, str(e), param=e.param, code=e.code)
        return await complete(body, prompts, samplings, None, chat=True)(request)

    return app


def serve(model_spec, host="127.0.0.1", port=8000, max_batch=None, max_waiting=256, batch_invariant=False,
          precision="fp32", chat_template=None, threads=None):
    """Load the model, then serve until SIGTERM / Ctrl-C (in-flight requests finish first)."""
    import uvicorn
    from pathlib import Path
    if model_spec and not model_spec.startswith("random:") and not Path(model_spec).is_dir():
        raise Gpt2ffnError(f"model {model_spec!r} is neither a checkpoint directory nor random:<preset>[:seed]")
    if chat_template and not Path(chat_template).is_file():
        raise Gpt2ffnError(f"--chat-template {chat_template!r} is not a file")
    svc = Service(model_spec, max_batch, max_waiting, batch_invariant, precision, chat_template, threads)
    app = create_app(svc)
    print(f"gpt2ffn: serving {model_spec or 'openai-community/gpt2'} on http://{host}:{port} "
          "(OpenAPI: /docs, /openapi.json)", flush=True)
    # uvicorn drains, restores the handlers it found, then re-raises SIGTERM: let that end the process with 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=60)
