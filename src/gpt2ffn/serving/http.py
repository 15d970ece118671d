"""`gpt2ffn serve`: OpenAI-compatible completions over HTTP (FastAPI + uvicorn).

The routes only translate: a request body (serving/protocol.py) becomes engine requests through the Service
(serving/service.py), whose engine thread, or engine process (serving/core.py), runs the model; its Tokens come
back as JSON or server-sent events. The event loop never runs the model. Beyond --max-batch running and
--max-waiting queued requests: 503 with Retry-After. A client that disconnects frees its slot at the next step.
SIGTERM (uvicorn's graceful shutdown) stops accepting, lets in-flight requests finish, exits. Every error is JSON
in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, naming the field at fault.

Beyond localhost: with API keys (--api-key, GPT2FFN_API_KEY) every path but /health and the API's docs (and
/metrics with --metrics-public) needs `Authorization: Bearer KEY`, else 401 before the body is read; TLS is
uvicorn's (--ssl-certfile, --ssl-keyfile); --limit-concurrency is uvicorn's, its 503 in OpenAI's shape.
"""

import asyncio
import contextlib
import hashlib
import hmac
import importlib
import ipaddress
import json
import math
import os
import pickle
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Annotated

import jinja2.exceptions
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import Config
from ..errors import Gpt2ffnError
from ..loading import load_args
from ..model import check_spec, parse_random
from ..tokenizer import has_tokenizer_files
from ..tokenizer import no_tokenizer as no_tokenizer_files
from .core import EngineGone, EngineProcess, check_max_len, child_env
from .engine import SHUTTING_DOWN, QueueFull, TooMany
from .engine import Request as EngineRequest
from .protocol import (
    ChatCompletion,
    ChatRequest,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from .service import MAX_CHOICES, BadRequest, Choices, Service

MAX_BODY = 1 << 20  # 1 MiB: a GPT-2 context is 1024 tokens, a few KiB of text
ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 499, 500, 503)}
OPEN_PATHS = {"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}  # no key needed, ever

router = APIRouter()


async def service(request: Request) -> Service:
    """The FastAPI dependency every route takes: the app's Service (async: FastAPI runs a plain function in its
    thread pool, a thread hop for every request)."""
    return request.app.state.service


ServiceDep = Annotated[Service, Depends(service)]


def error(status: int, message: str, param=None, code=None, kind="invalid_request_error", headers=None):
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def refuse(svc: Service, status: int, message: str, **kw) -> JSONResponse:
    """An error response, counted in gpt2ffn_requests_total by its status."""
    svc.metrics.requests.labels(str(status)).inc()
    return error(status, message, **kw)


def loading():
    """The 503 (with Retry-After) of every route that reads the model while it loads."""
    return error(503, "the model is still loading", kind="unavailable", headers={"Retry-After": "5"})


def no_tokenizer(svc: Service, param: str) -> JSONResponse:
    return refuse(svc, 400, f"{param}: this server has no tokenizer (--skip-tokenizer-init): it takes and gives "
                            "token ids only", param=param, code="no_tokenizer")


def unready(svc: Service, model: str | None):
    """503 while loading, 404 for another model's name, else None (None: the served model)."""
    if not svc.ready.is_set():
        return loading()
    if model is not None and model not in svc.names:
        names = " or ".join(map(repr, svc.names))
        return refuse(svc, 404, f"model {model!r} does not exist; this server has {names}",
                      param="model", code="model_not_found")
    return None


# -- routes ---------------------------------------------------------------------------------------------------
@router.get("/health", response_model=Health, responses={503: {"model": ErrorResponse}})
async def health(svc: ServiceDep):
    if not svc.ready.is_set():
        return loading()
    if getattr(svc.engine, "gone", None):
        return error(503, svc.engine.gone, kind="server_error")
    running, waiting, _ = svc.engine.counts()
    return {"status": "ok", "model": svc.name, "running": running, "waiting": waiting}


@router.get("/metrics", response_class=Response)
async def metrics(svc: ServiceDep):
    """Prometheus text exposition (vLLM's metric names, gpt2ffn_ prefix)."""
    if svc.engine is not None:
        svc.metrics.counts(svc.engine)
    text = svc.metrics.render()
    if isinstance(svc.engine, EngineProcess):  # the engine's part, from its process
        if not svc.ready.is_set() and not svc.engine.gone:  # it reads no channel while it loads
            return loading()
        part = await svc.engine.exposition()
        if part is None:  # a scrape that fails, as /health does: the counts would be missing, not zero
            return error(503, svc.engine.gone or "the engine process did not answer for its metrics in 5 s",
                         kind="server_error")
        text += part
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def models(svc: ServiceDep):
    if not svc.ready.is_set():  # its name and context are known once it has loaded
        return loading()
    return {"object": "list", "data": [card(svc, name) for name in svc.names]}


def card(svc: Service, name: str) -> dict:
    return {"id": name, "object": "model", "created": svc.loaded_at, "owned_by": "gpt2ffn",
            "max_model_len": svc.max_len}


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=ERRORS)
async def model_card(model: str, svc: ServiceDep):
    """OpenAI's models.retrieve: this server's one model, by its name."""
    return unready(svc, model) or card(svc, model)


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
async def tokenize(body: TokenizeRequest, svc: ServiceDep):
    text = body.prompt if body.prompt is not None else body.content
    if not svc.ready.is_set():
        return loading()
    if text is None:
        return refuse(svc, 400, "prompt: a string to tokenize is required", param="prompt")
    if svc.tok is None:
        return no_tokenizer(svc, "prompt")
    ids = svc.tok.encode(text)
    return {"tokens": ids, "count": len(ids), "max_model_len": svc.max_len}


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
async def detokenize(body: DetokenizeRequest, svc: ServiceDep):
    if not svc.ready.is_set():
        return loading()
    V = svc.config.vocab_size
    if any(not 0 <= t < V for t in body.tokens):
        return refuse(svc, 400, f"tokens: ids must be in [0, {V})", param="tokens")
    if svc.tok is None:
        return no_tokenizer(svc, "tokens")
    text = svc.tok.decode(body.tokens)
    return {"prompt": text, "content": text}


@router.post("/v1/completions", response_model=Completion, response_model_exclude_unset=True, responses=ERRORS)
async def completions(body: CompletionRequest, request: Request, svc: ServiceDep):
    """A completion of each prompt (n each); with stream: true, server-sent events of text_completion chunks."""
    bad = unready(svc, body.model)
    if bad is not None:
        return bad
    try:
        prompts = svc.prompts(body.prompt)
        samplings = svc.sampling(body, prompts, body.max_tokens, body.logprobs, body.echo, default=16)
    except BadRequest as e:
        return refuse(svc, e.status, str(e), param=e.param, code=e.code)
    echo = [svc.tok.decode(p) if svc.tok is not None else "" for p in prompts] if body.echo else None
    return await respond(svc, request, body.stream, prompts, samplings, Choices(svc, body, prompts, samplings, echo))


@router.post("/v1/chat/completions", response_model=ChatCompletion, response_model_exclude_unset=True,
             responses=ERRORS)
async def chat(body: ChatRequest, request: Request, svc: ServiceDep):
    """Chat through --chat-template (GPT-2 has none of its own); streamed as chat.completion.chunk events."""
    if svc.template is None:
        return refuse(svc, 400, "GPT-2 has no chat template: use /v1/completions with a prompt (or start the "
                                "server with --chat-template FILE)", param="messages", code="no_chat_template")
    bad = unready(svc, body.model)
    if bad is not None:
        return bad
    try:
        text = svc.template.render(messages=[m.for_template() for m in body.messages],
                                   add_generation_prompt=body.add_generation_prompt,
                                   bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    except jinja2.exceptions.TemplateError as e:  # the template's raise_exception, or a value it cannot render
        return refuse(svc, 400, f"messages: the chat template refused them: {e}", param="messages")
    try:
        prompts = svc.prompts(text)
        if body.top_logprobs is not None and not body.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        kind = (body.response_format or {}).get("type", "text")
        if kind != "text":
            raise BadRequest(f"response_format {kind!r} is not supported: this server decodes without a grammar "
                             "(only 'text')", "response_format")
        samplings = svc.sampling(body, prompts, body.max_completion_tokens or body.max_tokens,
                                 (body.top_logprobs or 0) if body.logprobs else None, source="messages")
    except BadRequest as e:
        return refuse(svc, e.status, str(e), param=e.param, code=e.code)
    return await respond(svc, request, body.stream, prompts, samplings, Choices(svc, body, prompts, samplings,
                                                                                chat=True))


# -- from engine Tokens to a response ---------------------------------------------------------------------
class Inbox:
    """Tokens from the engine thread to one event loop. The thread appends; the loop is woken once for all that
    arrived since it last looked (one call_soon_threadsafe per engine step, not one per token). With the engine in
    its own process the Tokens arrive on the loop's thread (core.EngineProcess reads them there): straight in."""

    def __init__(self, loop):
        self.loop, self.lock, self.items, self.woken = loop, threading.Lock(), [], False
        self.thread = threading.get_ident()  # the loop's (made in lifespan, on it)

    def put(self, box, item):
        """From the engine thread: item into box, on the loop's thread (dropped once the loop has closed: nobody
        is left to answer, and the engine thread must go on)."""
        if threading.get_ident() == self.thread:
            box.put(item)
            return
        with self.lock:
            self.items.append((box, item))
            if self.woken:
                return
            self.woken = True
        try:
            self.loop.call_soon_threadsafe(self.deliver)
        except RuntimeError:  # the event loop is closed
            with self.lock:
                self.items, self.woken = [], False

    def deliver(self):
        with self.lock:
            items, self.items, self.woken = self.items, [], False
        for box, item in items:
            box.put(item)


class Mailbox:
    """One API request's (choice, Token) pairs, taken all at once by the coroutine that answers it: when it
    falls behind (a slow client, a busy loop), the tokens that piled up go out together."""

    def __init__(self):
        self.items, self.waiter = [], None

    def put(self, item):
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def take(self, timeout: float) -> list:
        """Every pair that arrived, waiting up to `timeout` seconds for the first; [] if none came."""
        if not self.items:
            loop = asyncio.get_running_loop()
            self.waiter = waiter = loop.create_future()
            timer = loop.call_later(timeout, lambda: waiter.done() or waiter.set_result(None))
            try:
                await waiter
            finally:
                timer.cancel()
                self.waiter = None
        items, self.items = self.items, []
        return items


class Answer:
    """The engine requests of one API request and their (choice, Token) pairs as they come back."""

    def __init__(self, svc: Service, request: Request, reqs: list, box: Mailbox):
        self.svc, self.request, self.reqs, self.box, self.left = svc, request, reqs, box, len(reqs)
        self.failed = None   # the error response, once there is one
        self.done = False    # the whole answer went out
        self.asked = time.monotonic()  # when the connection was last asked whether the client is still there

    async def next(self):
        """The pairs that came since the last call (waiting for at least one); [] once every request finished;
        or an error response (after the pairs that came before it): 499 when the client left, 500 when the
        engine failed. Whether the client left is asked every 0.25 s, tokens coming or not (a non-streamed
        answer sends nothing until the end, so only asking tells)."""
        while self.left and self.failed is None:
            items = await self.box.take(0.25)
            if not items or time.monotonic() - self.asked >= 0.25:
                self.asked = time.monotonic()
                if await self.request.is_disconnected():
                    self.failed = refuse(self.svc, 499, "client closed the request")
                    continue
            if not items:
                continue
            for k, (_, ev) in enumerate(items):
                if ev.finish_reason == "error":
                    self.failed = (refuse(self.svc, 503, ev.text, kind="server_error")
                                   if ev.text.startswith(SHUTTING_DOWN) else
                                   refuse(self.svc, 500, f"generation failed: {ev.text}", kind="server_error"))
                    if k:
                        return items[:k]
                    break
                self.left -= ev.finish_reason is not None
            else:
                return items
        return self.failed or []

    def abort(self):
        """Stop what is still running (a client that left, an error): its slots free at the next step."""
        for r in self.reqs:
            if r.finish_reason is None:
                self.svc.engine.abort(r)


async def submit(svc: Service, request: Request, prompts: list, samplings: list, choices: Choices):
    """One engine request per choice, queued: an Answer, or an error response (503 beyond --max-waiting),
    before any byte of the answer is sent."""
    box, inbox = Mailbox(), request.app.state.inbox
    reqs = []
    for c, s in enumerate(samplings):
        def sink(ev, c=c):
            inbox.put(box, (c, ev))
        reqs.append(EngineRequest(prompts[c // (len(samplings) // len(prompts))], s, sink))
    try:
        if isinstance(svc.loop, EngineProcess):
            await svc.loop.submit(*reqs)  # the engine process decides (every API process sends it requests)
        else:
            svc.loop.submit(*reqs)
    except QueueFull as e:
        return refuse(svc, 503, f"the server is busy ({e}); retry shortly", kind="server_busy",
                      headers={"Retry-After": "1"})
    except EngineGone as e:
        return refuse(svc, 503, str(e), kind="server_error")
    except TooMany as e:  # choices of each prompt (n, or best_of where it is more): the field to lower
        many = "best_of" if choices.per_prompt > choices.keep else "n" if choices.per_prompt > 1 else "prompt"
        return refuse(svc, 400, str(e), param=many)
    except Gpt2ffnError as e:
        return refuse(svc, 400, str(e), param="prompt")
    svc.metrics.counts(svc.engine)
    return Answer(svc, request, reqs, box)


async def respond(svc: Service, request: Request, stream: bool, prompts: list, samplings: list, choices: Choices):
    """Queue the choices, then answer with the whole response or a stream of server-sent events."""
    answer = await submit(svc, request, prompts, samplings, choices)
    if not isinstance(answer, Answer):
        return answer
    if stream:
        return Stream(svc, answer, choices)
    try:
        while items := await answer.next():
            if not isinstance(items, list):
                return items
            for c, ev in items:
                choices.collect(c, ev)
    finally:
        answer.abort()
    svc.metrics.requests.labels("200").inc()
    return choices.response()


class Stream(StreamingResponse):
    """The server-sent events of a streamed answer (sse). However the response ends (the whole answer, an error,
    the client gone, even before the first chunk), what still runs is aborted and the request counted: 200 for
    a whole answer; 499 for a client that left mid-stream (an error's own status was counted where it arose)."""

    def __init__(self, svc: Service, answer: Answer, choices: Choices):
        super().__init__(sse(answer, choices, answer.request.app.state.stream_interval),
                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.svc, self.answer = svc, answer

    async def __call__(self, scope, receive, send):
        try:
            # Not StreamingResponse.__call__: under uvicorn's ASGI 2.3 it runs the stream in an anyio task group
            # beside a task that waits for the client to leave, per request; Answer.next asks every 0.25 s instead.
            await self.stream_response(send)
        finally:
            a = self.answer
            a.abort()
            if a.done:
                self.svc.metrics.requests.labels("200").inc()
            elif a.failed is None:
                self.svc.metrics.requests.labels("499").inc()

    async def stream_response(self, send):
        """Starlette's, but the piece that ends with [DONE] also ends the body: one write to the socket, not two."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:
            ended = chunk.endswith(DONE)
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


DONE = "data: [DONE]\n\n"


def due(held: list, shown: set, interval: int) -> bool:
    """Whether the held (choice, Token) pairs go out now: a choice's first token (the time to first token is not
    delayed), a finish, or `interval` tokens of one choice since its last chunk."""
    if interval == 1:
        return True
    count = {}
    for c, ev in held:
        if ev.finish_reason or c not in shown:
            return True
        count[c] = count.get(c, 0) + 1
    return max(count.values()) >= interval


def events(chunks: list) -> str:
    return "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks)


async def sse(answer: Answer, choices: Choices, interval: int = 1):
    """Per choice a chunk of the text that came since the last one (one token, or several when the client or the
    loop fell behind, or with --stream-interval N every N tokens after the first), [DONE] last (an error body
    instead if the engine failed, after the tokens that came before it). The last tokens, the usage and [DONE] go
    out as one piece (one write to the socket)."""
    if choices.chat:
        yield f"data: {json.dumps(choices.role_chunk())}\n\n"
    held, shown = [], set()
    while items := await answer.next():
        if not isinstance(items, list):
            if held:
                yield events(choices.chunks(held))
            yield f"data: {items.body.decode()}\n\n"
            return
        held += items
        if not answer.left:  # every choice finished: these go out with the end
            break
        if not due(held, shown, interval):
            continue
        chunks, held = choices.chunks(held), []
        shown.update(chunk["choices"][0]["index"] for chunk in chunks)  # a first token with no text yet waits on
        out = events(chunks)
        if out:
            yield out
    if await answer.request.is_disconnected():  # gone since Answer.next last asked (it asks every 0.25 s)
        answer.failed = refuse(answer.svc, 499, "client closed the request")
        return
    tail = events(choices.chunks(held)) if held else ""  # (first: the usage counts these tokens)
    if choices.include_usage:
        tail += f"data: {json.dumps(choices.usage_chunk())}\n\n"
    yield tail + DONE
    answer.done = True


# -- the app ----------------------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    # Bind first, load in the background: /health answers 503 until the weights are in.
    svc = app.state.service
    app.state.inbox = Inbox(asyncio.get_running_loop())
    threading.Thread(target=svc.load_or_exit, args=(asyncio.get_running_loop(),), name="gpt2ffn-loader",
                     daemon=True).start()
    yield
    if svc.loop is not None:  # after uvicorn has drained in-flight requests: stop the engine thread
        svc.loop.stop()


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def authorized(header: str | None, digests: list) -> bool:
    """Whether an Authorization header carries one of the keys (as digests). Every key is compared, in constant
    time, on SHA-256 digests: the timing tells neither a key's length nor whether or which one matched."""
    scheme, _, token = (header or "").partition(" ")
    given, match = digest(token.strip()), False
    for d in digests:
        match |= hmac.compare_digest(given, d)
    return match and scheme.lower() == "bearer"


def replay(body: bytes, receive):
    """An ASGI receive that gives `body` whole once, then whatever `receive` gives (the client's disconnect)."""
    sent = False

    async def again():
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}
    return again


class Gate:
    """Before a body is read: 401 without a valid API key (when the server has keys) on any path but the open
    ones, then 413 for a body over the limit (by its Content-Length, or, sent chunked, read here up to the
    limit and handed on whole), each counted in gpt2ffn_requests_total. Plain ASGI, so an answer's body passes
    through untouched (Starlette's BaseHTTPMiddleware relays each streamed chunk through a memory stream and two
    task switches)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        refused = self.check(request)
        if refused is None and "content-length" not in request.headers:  # chunked: counted as it arrives
            body, limit = bytearray(), request.app.state.max_body
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client left before its body was whole: no one to answer
                body += message.get("body", b"")
                if len(body) > limit:
                    refused = refuse(request.app.state.service, 413,
                                     f"request body (chunked) exceeds the limit of {limit} bytes",
                                     code="request_too_large")
                    break
                if not message.get("more_body", False):
                    receive = replay(bytes(body), receive)
                    break
        await (refused or self.app)(scope, receive, send)

    @staticmethod
    def check(request: Request):
        state, path = request.app.state, request.url.path
        guarded = path not in OPEN_PATHS and not (path == "/metrics" and state.metrics_public)
        if state.api_keys and guarded and not authorized(request.headers.get("authorization"), state.api_keys):
            given = "authorization" in request.headers
            return refuse(state.service, 401, "invalid API key" if given else
                          "missing API key: send the header `Authorization: Bearer KEY`", code="invalid_api_key",
                          headers={"WWW-Authenticate": "Bearer"})
        length, limit = request.headers.get("content-length"), state.max_body
        if length is not None and (not length.isdigit() or int(length) > limit):
            return refuse(state.service, 413, f"request body of {length} bytes exceeds the limit of {limit} bytes",
                          code="request_too_large")
        return None


# What a field that takes one of several shapes takes, said where a value fits none (pydantic would name the
# first shape it tried: "prompt.str: Input should be a valid string").
SHAPES = {"prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
          "stop": "a string or a list of strings", "content": "a string or a list of text parts "
          "({\"type\": \"text\", \"text\": ...}: GPT-2 reads text only)"}


def _union_tag(part) -> bool:
    """A loc part that names one shape of a union (str, list[int], function-after[...]), not a field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "dict", "list", "none"))


async def invalid(request: Request, exc: RequestValidationError):
    """A body that does not fit the protocol: 400 naming the first field at fault."""
    first = exc.errors()[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    where = [str(p) for p in loc[:next((i for i, p in enumerate(loc) if _union_tag(p)), len(loc))]]
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    field = (first.get("ctx") or {}).get("field")
    if field is not None:  # a field named by a check of the whole body
        where = [field]
    elif len(where) < len(loc) and where and where[-1] in SHAPES:
        message = f"must be {SHAPES[where[-1]]}"
    if first.get("type") == "json_invalid":  # its loc is the byte offset, not a field
        at, where = where, []
        message = (f"the request body is not valid JSON (at byte {at[0]})" if at
                   else "the request body is not valid JSON")
    elif not where and "json" not in request.headers.get("content-type", ""):
        message = (f"the request body must be a JSON object sent with Content-Type: application/json (curl: -H "
                   f"'Content-Type: application/json'); got {request.headers.get('content-type') or 'none'}")
    elif not where and first.get("type") == "missing":
        message = "the request body is empty: send a JSON object"
    return refuse(request.app.state.service, 400, f"{'.'.join(where) + ': ' if where else ''}{message}",
                  param=".".join(where) or None)


async def http_error(request: Request, exc: StarletteHTTPException):
    """404, 405 and the like (a route or method that does not exist, a body that cannot be parsed) in OpenAI's
    error shape, as every other error."""
    detail = exc.detail if isinstance(exc.detail, str) else "error"
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    if exc.status_code == 400 and detail.startswith("There was an error parsing the body"):
        return refuse(request.app.state.service, 400, unparsable(await request.body()))
    return refuse(request.app.state.service, exc.status_code, f"{detail}: {request.method} {request.url.path}",
                  kind=kind, headers=getattr(exc, "headers", None))


def unparsable(body: bytes) -> str:
    """Why a body FastAPI could not parse is not JSON: its bytes are not UTF-8, or it nests too deeply."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"the request body is not UTF-8 text (byte 0x{body[e.start]:02x} at offset {e.start}); JSON is UTF-8"
    try:
        json.loads(text)
    except RecursionError:
        return "the request body nests arrays or objects too deeply to parse"
    except ValueError as e:
        return f"the request body is not valid JSON ({e})"
    return "the request body could not be parsed as JSON"


async def crashed(request: Request, exc: Exception):
    """A bug: 500 in OpenAI's shape (JSON, counted), not a plain-text page. The traceback goes to the log."""
    return refuse(request.app.state.service, 500, f"internal error: {type(exc).__name__}: {exc}".splitlines()[0],
                  kind="server_error")


def create_app(svc: Service, max_body: int = MAX_BODY, api_keys=(), metrics_public: bool = False,
               stream_interval: int = 1) -> FastAPI:
    """The FastAPI app over `svc`: routes, API keys, the body limit and the OpenAI-shaped validation errors.
    stream_interval (SGLang's --stream-interval): a stream's chunks after the first carry N tokens of a choice."""
    app = FastAPI(title="gpt2ffn", version=__import__("gpt2ffn").__version__, lifespan=lifespan,
                  description="OpenAI-compatible completions over gpt2ffn's GPT-2, continuously batched.")
    app.state.service, app.state.max_body, app.state.stream_interval = svc, max_body, stream_interval
    app.state.api_keys, app.state.metrics_public = [digest(k) for k in api_keys], metrics_public
    app.add_middleware(Gate)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, crashed)
    app.include_router(router)
    return app


def loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only (every address it stands for is a loopback one)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


def check_keys(api_keys) -> list:
    for k in api_keys:
        if not k or not k.isprintable() or any(c.isspace() for c in k):
            raise Gpt2ffnError("--api-key: a key must be non-empty printable text without spaces (it travels in "
                               "the header `Authorization: Bearer KEY`)")
    return list(api_keys)


def check_tls(certfile, keyfile):
    """A readable certificate and key (uvicorn would fail later, inside its startup)."""
    if keyfile and not certfile:
        raise Gpt2ffnError("--ssl-keyfile needs --ssl-certfile")
    if certfile:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile)
        except (OSError, ssl.SSLError) as e:
            raise Gpt2ffnError(f"--ssl-certfile {certfile!r} / --ssl-keyfile {keyfile!r}: cannot load the "
                               f"certificate and its key: {e}") from None


def busy_in_openai_shape(svc: Service):
    """uvicorn answers beyond --limit-concurrency with a plain-text 503 of its own, before the app sees the
    request; put OpenAI's error shape (and Retry-After) in its place, counted in gpt2ffn_requests_total."""
    body = json.dumps({"error": {"message": "the server is at its connection limit (--limit-concurrency); retry "
                                            "shortly", "type": "server_busy", "param": None, "code": None}}).encode()

    async def busy(scope, receive, send):
        svc.metrics.requests.labels("503").inc()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"retry-after", b"1"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    for name in ("h11_impl", "httptools_impl", "zttp_impl", "zttp_h2_impl"):
        try:
            module = importlib.import_module(f"uvicorn.protocols.http.{name}")
        except ImportError:  # its parser is not installed: uvicorn will not use it either
            continue
        if hasattr(module, "service_unavailable"):
            module.service_unavailable = busy


def serve(model_spec, host="127.0.0.1", port=8000, max_batch=None, max_waiting=256, batch_invariant=False,
          precision="fp32", chat_template=None, threads=None, device="cpu", dtype=None, kv_fraction=None, tp=1,
          rank=0, api_keys=(), metrics_public=False, ssl_certfile=None, ssl_keyfile=None, limit_concurrency=None,
          max_model_len=None, max_n=16, activations=None, kv_dtype=None, graph_seconds=60.0, cuda_graphs=True,
          skip_tokenizer=False, served_names=(), shutdown_timeout=60.0, stream_interval=1, engine_process="auto",
          api_servers=1):
    """Load the model, then serve until SIGTERM / Ctrl-C (in-flight requests finish first).
    tp > 1 (under torchrun, process group joined): rank 0 serves; the other ranks run its forward passes.
    skip_tokenizer (vLLM's --skip-tokenizer-init): no tokenizer is read; prompts are token ids, and each choice
    carries its token_ids (its text is empty). served_names (vLLM's --served-model-name): the names requests may
    give as "model", the first the one /v1/models lists first; default the loaded model's own name.
    engine_process: 'on' runs the engine in a process of its own (serving/core.py), 'off' in a thread of this one,
    'auto' (default): its own process on CUDA, a thread on the CPU (see README, "HTTP server"). api_servers > 1
    (vLLM's --api-server-count): that many processes serve HTTP on the one socket, in front of the engine's own."""
    if any(not name.strip() for name in served_names) or len(set(served_names)) < len(served_names):
        raise Gpt2ffnError(f"--served-model-name takes distinct, non-empty names, got {list(served_names)}")
    if model_spec is not None:  # an unknown preset or model is one line here, before "serving on"
        model_spec = check_spec(model_spec)  # (a pathlib.Path as its text)
    if chat_template and not Path(chat_template).is_file():
        raise Gpt2ffnError(f"--chat-template {chat_template!r} is not a file")
    if model_spec and Path(model_spec).is_dir() and not skip_tokenizer and not has_tokenizer_files(model_spec):
        raise no_tokenizer_files(model_spec)  # before the port is bound, not from the loading thread
    if chat_template and skip_tokenizer:
        raise Gpt2ffnError("--chat-template renders text, which needs the tokenizer: not with --skip-tokenizer-init")
    # a missing GPU, or flags load() refuses together (--precision int8 --dtype bfloat16), is one line and exit 2
    # here, before the port is bound
    device = load_args(dtype, precision, device, tp, activations)[0]
    if engine_process not in ("auto", "on", "off"):
        raise Gpt2ffnError(f"--engine-process must be auto, on or off, got {engine_process!r}")
    processes(engine_process, api_servers, tp)
    own_process = engine_process == "on" or api_servers > 1 or (engine_process == "auto" and device.startswith("cuda")
                                                                and tp == 1)
    if kv_fraction is not None and not 0 < kv_fraction <= 1:
        raise Gpt2ffnError(f"--kv-cache-fraction must be in (0, 1], got {kv_fraction!r}")
    # uvicorn counts the connection asking among its connections: --limit-concurrency 1 would refuse everything
    for flag, value, least, most in (("--max-model-len", max_model_len, 1, None), ("--max-n", max_n, 1, MAX_CHOICES),
                                     ("--limit-concurrency", limit_concurrency, 2, None),
                                     ("--max-batch", max_batch, 1, None), ("--max-waiting", max_waiting, 0, None),
                                     ("--threads", threads, 1, None), ("--stream-interval", stream_interval, 1, None)):
        if value is not None and not least <= value <= (most or value):
            raise Gpt2ffnError(f"{flag} must be in [{least}, {most or 'inf'}], got {value}")
    if not 0 <= shutdown_timeout < float("inf"):
        raise Gpt2ffnError(f"--shutdown-timeout must be >= 0 seconds, got {shutdown_timeout}")
    if not graph_seconds >= 0:
        raise Gpt2ffnError(f"--cuda-graph-seconds must be >= 0, got {graph_seconds}")
    api_keys = check_keys(api_keys)
    check_tls(ssl_certfile, ssl_keyfile)
    if max_model_len is not None and model_spec and (model_spec.startswith("random:") or Path(model_spec).is_dir()):
        check_max_len(max_model_len, (parse_random(model_spec)[0] if model_spec.startswith("random:") else
                                      Config.from_pretrained(model_spec)).n_positions)  # not after "serving on"
    sock, failed = None, None
    if rank == 0:  # bound before anything loads: a port in use is one line
        try:
            sock = listen(host, port)
        except Gpt2ffnError as e:
            failed = str(e)
    if tp > 1:  # every rank learns it: a follower would wait for passes that never come (then a gloo traceback)
        import torch.distributed as dist
        box = [failed]
        dist.broadcast_object_list(box, src=0)
        failed = box[0]
    if failed is not None:
        raise Gpt2ffnError(failed)
    service = dict(model_spec=model_spec, max_batch=max_batch, max_waiting=max_waiting,
                   batch_invariant=batch_invariant, precision=precision, chat_template=chat_template, threads=threads,
                   device=device, dtype=dtype, kv_fraction=kv_fraction, max_model_len=max_model_len, max_n=max_n,
                   tp=tp, activations=activations, kv_dtype=kv_dtype, graph_seconds=graph_seconds,
                   cuda_graphs=cuda_graphs, skip_tokenizer=skip_tokenizer, served_names=served_names,
                   freeze_heap=True)
    if rank != 0:
        svc = Service(**service)
        svc.load()
        svc.engine.follow()  # returns when rank 0's engine thread stops
        return
    svc = Service(**service, engine_process=own_process, api_servers=api_servers)
    if svc.channels:  # at shutdown the engine ends once every API process has drained: wait as long as they may
        svc.engine.patience = shutdown_timeout + DRAIN_GRACE + 30
    front = dict(host=host, port=port, api_keys=api_keys, metrics_public=metrics_public,
                 stream_interval=stream_interval, limit_concurrency=limit_concurrency, ssl_certfile=ssl_certfile,
                 ssl_keyfile=ssl_keyfile, shutdown_timeout=shutdown_timeout)
    if not api_keys and not loopback(host):
        print(f"warning: serving on {host} without an API key: anyone who can reach port {port} can use it "
              "(give --api-key KEY or set GPT2FFN_API_KEY)", file=sys.stderr, flush=True)
    scheme = "https" if ssl_certfile else "http"
    port = front["port"] = sock.getsockname()[1]  # --port 0: the one the system gave
    print(f"gpt2ffn: listening on {scheme}://{host}:{port}, loading {model_spec or 'openai-community/gpt2'} "
          f"(/health answers 503 until it is in; OpenAPI: /docs, /openapi.json; {len(api_keys) or 'no'} API "
          f"key{'s' * (len(api_keys) != 1)})", flush=True)
    workers = [start_worker(sock, channel, service, front) for channel in svc.channels]
    for w in workers:
        threading.Thread(target=watch, args=(w, svc), name="gpt2ffn-watch", daemon=True).start()
    ending = None
    try:
        run_front(svc, sock, workers=workers, **front)
    except (SystemExit, KeyboardInterrupt) as e:  # SIGTERM's exit(0), or Ctrl-C's re-raised interrupt
        ending = e
    finally:
        for w in workers:  # they drain as this one did (run_front passed the signal on), within the same time
            try:
                w.wait(shutdown_timeout + DRAIN_GRACE + 5)
            except subprocess.TimeoutExpired:
                w.kill()
    if ending is None and svc.interrupted:
        # SIGINT that uvicorn took and did not re-raise: it puts back the handler it found, and a process started
        # in the background by a shell (`gpt2ffn serve ... &` in a script) begins with SIGINT ignored. Ctrl-C is
        # still Ctrl-C: 130, and during the load, the exit below (the interpreter's teardown aborted, 134).
        ending = KeyboardInterrupt()
    if ending is not None and not svc.ready.is_set():
        # Ended while the model loads: the loader thread may be inside native code (OpenMP), which the interpreter's
        # teardown would abort ("terminate called without an active exception", exit 134). Nothing runs: leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if isinstance(ending, KeyboardInterrupt) else ending.code if isinstance(ending.code, int) else 0)
    if svc.died:  # the engine process ended unasked (a signal during the drain that followed changes nothing)
        return 1
    if ending is not None:
        raise ending
    return 0


def processes(engine_process: str, api_servers: int, tp: int):
    """--engine-process and --api-servers against --tp (the CLI asks before it joins torchrun's group)."""
    if engine_process == "on" and tp > 1:
        raise Gpt2ffnError("--engine-process on does not combine with --tp: rank 0's engine runs the process "
                           "group's passes in torchrun's process")
    if api_servers < 1:
        raise Gpt2ffnError(f"--api-servers must be at least 1, got {api_servers}")
    if api_servers > 1 and (engine_process == "off" or tp > 1):
        raise Gpt2ffnError(f"--api-servers {api_servers} puts the engine in a process of its own: not with "
                           f"{'--engine-process off' if engine_process == 'off' else '--tp'}")


def run_front(svc: Service, sock, host="127.0.0.1", port=8000, api_keys=(), metrics_public=False, stream_interval=1,
              limit_concurrency=None, ssl_certfile=None, ssl_keyfile=None, shutdown_timeout=60.0, workers=()):
    """Serve HTTP on the bound `sock` until SIGTERM / Ctrl-C (passed on to `workers`, the other API processes)."""
    import uvicorn
    app = create_app(svc, api_keys=api_keys, metrics_public=metrics_public, stream_interval=stream_interval)
    if limit_concurrency:
        busy_in_openai_shape(svc)
    if ssl_certfile:
        # uvicorn closes idle keep-alive connections at SIGTERM; over TLS asyncio then waits for each client's
        # close_notify, 30 s by default, which an idle pooled client (the openai package's) never sends. What
        # the server had to send is flushed within it too (the transport holds at most 64 KiB): 3 s. uvicorn has
        # no option for create_server's ssl_shutdown_timeout; asyncio reads its default from here.
        asyncio.constants.SSL_SHUTDOWN_TIMEOUT = 3.0
    # uvicorn drains, restores the handlers it found, then re-raises SIGTERM: let that end the process with 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # uvloop and httptools where installed (the serve extra), except that TLS keeps asyncio's loop: uvloop has its
    # own TLS shutdown wait (30 s), which SSL_SHUTDOWN_TIMEOUT above does not reach
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=math.ceil(shutdown_timeout) + DRAIN_GRACE,
                            ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, limit_concurrency=limit_concurrency,
                            loop="asyncio" if ssl_certfile else "auto")
    draining_server()(config, svc, shutdown_timeout, workers).run(sockets=[sock])


def start_worker(sock, channel, service: dict, front: dict) -> subprocess.Popen:
    """One more API process (--api-servers): it serves on `sock` (the kernel hands each connection to one of them)
    with the engine process's `channel`; what it needs comes through its stdin. In a session of its own, so a
    terminal's Ctrl-C reaches only the first process, which passes each signal on (Draining.handle_exit)."""
    fds = (sock.fileno(), channel.fileno())
    proc = subprocess.Popen([sys.executable, "-m", "gpt2ffn.serving.http", *map(str, fds)], pass_fds=fds,
                            stdin=subprocess.PIPE, env=child_env(), start_new_session=True)
    proc.stdin.write(pickle.dumps((service, front, os.getpid())))
    proc.stdin.close()
    channel.close()  # the worker has its own copy
    return proc


def watch(proc: subprocess.Popen, svc: Service):
    """Say so when an API process ends while the server runs (the others go on serving the port)."""
    code = proc.wait()
    if not svc.ending:
        print(f"gpt2ffn: API process {proc.pid} exited (code {code}); the others serve on", file=sys.stderr,
              flush=True)


def worker(sock_fd: int, channel_fd: int):
    """An API process started by start_worker: serve until signalled (or until the first process is gone)."""
    service, front, parent = pickle.load(sys.stdin.buffer)

    def orphaned():  # the first process died without passing a signal on (a SIGKILL): drain and end as it would
        while os.getppid() == parent:
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=orphaned, name="gpt2ffn-parent", daemon=True).start()
    svc = Service(**service, engine=EngineProcess(Connection(channel_fd)), quiet=True)
    svc.engine.patience = front["shutdown_timeout"] + DRAIN_GRACE + 30  # as serve() gives the first process
    try:
        run_front(svc, socket.socket(fileno=sock_fd), **front)
    except KeyboardInterrupt:  # a third Ctrl-C passed on (uvicorn re-raises it): the first process says 130
        sys.exit(130)
    except SystemExit:  # SIGTERM's exit(0)
        pass
    sys.exit(1 if svc.died else 0)


# Shutdown (SIGTERM, Ctrl-C): in-flight requests get --shutdown-timeout seconds to finish; then what still runs
# ends with an error event (a stream closes properly: the client reads why; a whole answer is a 503), and uvicorn,
# DRAIN_GRACE later, closes the connections. A second Ctrl-C ends them at once, the same way.
DRAIN_GRACE = 5


def draining_server():
    """uvicorn's Server with gpt2ffn's drain (imported when a server starts, as uvicorn is)."""
    import uvicorn

    class Draining(uvicorn.Server):
        def __init__(self, config, svc, timeout: float, workers=()):
            super().__init__(config)
            self.svc, self.timeout, self.cutting, self.workers = svc, timeout, False, workers
            if isinstance(svc.engine, EngineProcess):
                svc.engine.died = self.engine_died

        def engine_died(self, why: str):
            # What was in flight has ended with an error naming why; a server that could only answer 503 from
            # now on ends instead (exit 1), so that a supervisor sees it and starts it again. Each API process
            # sees its channel end and ends the same way; the first says so.
            if self.svc.ending:
                return
            self.svc.ending, self.svc.died = True, why
            if not self.svc.quiet:
                print(f"gpt2ffn: {why}; the server ends (exit 1)", file=sys.stderr, flush=True)
            self.should_exit = True

        def cut(self, why: str):
            if self.svc.loop is not None:
                self.svc.loop.cut(f"{SHUTTING_DOWN} ({why}); the answer is cut here")

        def handle_exit(self, sig, frame):
            # The second Ctrl-C ends every request at once (each stream gets its error event and closes, so the
            # drain ends now); a third one is uvicorn's forced exit, which closes connections unsent.
            self.svc.ending = True
            self.svc.interrupted |= sig == signal.SIGINT
            for w in self.workers:  # the other API processes drain (or cut) as this one does: the first signal
                if w.poll() is None:  # reaches them as SIGTERM (a process still importing ends without a traceback)
                    w.send_signal(signal.SIGTERM if not self.should_exit else sig)
            if self.should_exit and sig == signal.SIGINT and not self.cutting:
                self.cutting = True
                self.cut("a second interrupt")
                return
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None):
            deadline = asyncio.get_running_loop().call_later(self.timeout, self.cut, f"requests still running "
                                                             f"after --shutdown-timeout {self.timeout:g} s")
            try:
                await super().shutdown(sockets)
            finally:
                deadline.cancel()
            if self.force_exit and hasattr(self, "lifespan"):  # uvicorn skips it then: the app's shutdown (the
                await self.lifespan.shutdown()                  # engine thread stopped) runs all the same

    return Draining


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound (uvicorn listens on it): a host that does not resolve or a port in use is a
    Gpt2ffnError here, before the model loads (uvicorn's own bind failed after it had started loading)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise Gpt2ffnError(f"--host {host!r} does not resolve: {e.strerror}") from None
    except (UnicodeError, ValueError) as e:  # a label over 63 characters, a NUL
        raise Gpt2ffnError(f"--host {host!r} is not a host name: {e}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise Gpt2ffnError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


if __name__ == "__main__":  # an API process of `serve --api-servers N` (start_worker)
    worker(int(sys.argv[1]), int(sys.argv[2]))
