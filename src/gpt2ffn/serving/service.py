"""What the HTTP routes serve: the model, its tokenizer, the engine and the thread that steps it (Service),
the translation of an API request into engine requests, and of their Tokens back into API objects (Choices).

It knows the protocol's bodies and the engine, not HTTP: a route's bad input is a BadRequest here, turned
into an error response by serving/http.py.
"""

import gc
import os
import re
import sys
import threading
import time
import uuid

from ..errors import Gpt2ffnError
from ..loading import tokenizer_for
from .core import Counted, EngineProcess, build, describe, start_engine
from .engine import Loop
from .metrics import Metrics
from .protocol import SamplingFields
from .sampling import Sampling

MAX_CHOICES = 128   # prompts x n in one request


class BadRequest(Exception):
    """A request the server refuses: the HTTP status, the field at fault and OpenAI's error code."""

    def __init__(self, message, param=None, status=400, code=None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class Service:
    """The model's config, its tokenizer, the engine and what steps it: a thread of this process (Loop), or with
    engine_process the engine's own process (serving/core.py: EngineProcess stands for both)."""

    def __init__(self, model_spec, max_batch=None, max_waiting=256, batch_invariant=False, precision="fp32",
                 chat_template=None, threads=None, device="cpu", dtype=None, kv_fraction=None, max_model_len=None,
                 max_n=16, tp=1, activations=None, kv_dtype=None, graph_seconds=60.0, cuda_graphs=True,
                 skip_tokenizer=False, served_names=(), freeze_heap=False, engine_process=False, engine=None,
                 quiet=False, api_servers=1):
        self.model_spec, self.tp, self.max_batch, self.max_waiting = model_spec, tp, max_batch, max_waiting
        self.freeze_heap = freeze_heap  # a server's own process: see core.build()
        self.device, self.dtype, self.kv_fraction, self.activations = device, dtype, kv_fraction, activations
        self.kv_dtype, self.graph_seconds, self.cuda_graphs = kv_dtype, graph_seconds, cuda_graphs
        self.threads, self.max_model_len, self.max_n = threads, max_model_len, max_n
        self.max_len = None  # prompt + max_tokens a request may reach: --max-model-len, or the model's context
        self.batch_invariant, self.precision = batch_invariant, precision
        self.skip_tokenizer = skip_tokenizer  # token ids in and out (vLLM's --skip-tokenizer-init): tok is None
        self.served_names = list(served_names)  # vLLM's --served-model-name: what requests may call the model
        self.engine_process = engine_process = engine_process or engine is not None or api_servers > 1
        self.api_servers, self.channels = api_servers, []  # the channels of the other API processes (serve())
        self.ending = False  # a signal to end has come (serve() then expects its API processes to end)
        self.interrupted = False  # that signal was SIGINT (Ctrl-C): serve() ends with 130
        self.died = None     # why the engine process ended unasked (the server then ends with exit 1)
        self.quiet = quiet  # an API process beside serve()'s own (--api-servers): the first one speaks
        self.names = []  # the names a request's "model" may be: served_names, else the loaded model's own name
        self.template = None
        if chat_template:
            self.template = load_template(chat_template)
        self.model = self.config = self.tok = self.name = self.loaded = self.engine = self.loop = None
        self.ready = threading.Event()
        self.metrics = Metrics(server=not engine_process, engine=not engine_process)
        if engine_process:  # the engine process starts loading now (given: started by serve(), shared)
            if engine is None:
                proc, (conn, *self.channels) = start_engine(self.settings(), api_servers)
                engine = EngineProcess(conn, proc)
            self.engine = self.loop = engine
            self.metrics.requests = Counted(engine)  # every API process's requests, counted in the engine's process

    def settings(self) -> dict:
        """What core.build() loads and builds from (sent to the engine process as it is)."""
        keys = ("model_spec", "dtype", "precision", "device", "tp", "activations", "kv_dtype", "skip_tokenizer",
                "threads", "max_model_len", "max_batch", "max_waiting", "batch_invariant", "kv_fraction",
                "graph_seconds", "cuda_graphs", "freeze_heap", "served_names", "max_n", "engine_process",
                "api_servers")
        return {k: getattr(self, k) for k in keys}

    def named(self, name: str):
        self.loaded = name
        self.loaded_at = int(time.time())  # /v1/models' "created": when this server loaded it
        self.names = self.served_names or [name]
        self.name = self.names[0]  # the one /v1/models and /health give

    def load(self):
        """The model and its engine in this process, stepped by a thread (Loop)."""
        self.model, self.tok, name, self.engine, self.max_len, self.max_batch = build(self.settings(), self.metrics)
        self.config = self.model.config
        self.named(name)
        if getattr(self.engine, "follower", False):
            return  # ranks > 0 of --tp run rank 0's forward passes (engine.follow()); no HTTP, no Loop
        self.loop = Loop(self.engine)
        self.ready.set()

    def load_remote(self, loop):
        """The engine in its own process (serving/core.py); here the tokenizer, read while it loads. The channel
        is read on `loop` (the server's event loop); ready is set there once it is."""
        try:
            self.tok = None if self.skip_tokenizer else tokenizer_for(self.model_spec)
            info = self.engine.wait_ready()
        except BaseException:
            if self.engine.proc is not None:
                self.engine.proc.kill()
            raise
        self.config, self.max_len, self.max_batch = info["config"], info["max_len"], info["max_batch"]
        self.named(info["name"])
        if self.freeze_heap:  # torch's modules and the tokenizer here too: no full collection walks them (core.build)
            gc.collect()
            gc.freeze()
        self.engine.attach(loop, self.ready.set)
        return info["lines"]

    def load_or_exit(self, loop=None):
        """load() (or load_remote(loop)), and on a bad model spec say so in one line and end the process with exit
        code 2."""
        try:
            if self.engine_process:
                lines = self.load_remote(loop)
            else:
                self.load()
                lines = describe(self.settings(), self.loaded, self.names, self.engine,
                                 self.model.transformer.wte.weight.dtype, self.max_batch, self.max_len, self.tok)
            for line in lines if not self.quiet else ():
                print(line, flush=True)
        except Exception as e:
            if self.engine_process and self.engine.halted:  # a signal came while it loaded: the server is ending
                return
            if not self.quiet:
                print(f"error: {e}", file=sys.stderr, flush=True)
            os._exit(2)

    # -- from a request body to engine requests --------------------------------------------------------------
    def prompts(self, prompt) -> list:
        """OpenAI's four prompt shapes -> a list of token-id lists."""
        cfg = self.config
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise BadRequest("prompt must not be an empty list", "prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        out = []
        for p in prompt:
            if isinstance(p, str) and self.tok is None:
                raise BadRequest("prompt: this server has no tokenizer (--skip-tokenizer-init): send token ids, "
                                 "a list of ints or a list of such lists", "prompt", code="no_tokenizer")
            ids = (self.tok.encode(p) or cfg.eos_ids[:1] or [cfg.bos_token_id or 0]) if isinstance(p, str) else list(p)
            if not ids:
                raise BadRequest("prompt: a token-id list must not be empty", "prompt")
            if min(ids) < 0 or max(ids) >= cfg.vocab_size:
                raise BadRequest(f"prompt has token ids outside this model's vocabulary [0, {cfg.vocab_size})",
                                 "prompt")
            out.append(ids)
        return out

    def sampling(self, body: SamplingFields, prompts: list, max_tokens: int | None, logprobs=None, echo=False,
                 default: int | None = None, source: str = "prompt") -> list:
        """One Sampling per candidate (prompt-major, best_of or n per prompt); candidate j gets seed + j.
        max_tokens None (not sent): `default` (completions: OpenAI's 16), or what the context has room for
        (chat, vLLM's), at most that room: a default never makes a request too long. source: the field the
        prompts came from, named where they are too long ("messages": a chat's, through its template)."""
        cfg = self.config
        longest = max(len(p) for p in prompts)
        what = f"prompt ({longest} tokens)" if source == "prompt" else f"{source} ({longest} tokens once templated)"
        limit = (f"the model's context of {self.max_len} tokens" if self.max_len == cfg.n_positions else
                 f"this server's --max-model-len of {self.max_len} tokens")
        if max_tokens is None:
            room = self.max_len - longest
            if room < 1:
                raise BadRequest(f"{what} leaves no room for a new token in {limit}", source,
                                 code="context_length_exceeded")
            max_tokens = room if default is None else min(default, room)
        elif max_tokens > self.max_len:
            raise BadRequest(f"max_tokens ({max_tokens}) exceeds {limit}", "max_tokens",
                             code="context_length_exceeded")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stop) > 4 or any(not s for s in stop):
            raise BadRequest("stop must be up to 4 non-empty strings", "stop")
        if stop and self.tok is None:
            raise BadRequest("stop: strings need a tokenizer and this server has none (--skip-tokenizer-init); "
                             "stop_token_ids takes ids", "stop", code="no_tokenizer")
        stop_ids = list(body.stop_token_ids or [])
        if any(not 0 <= t < cfg.vocab_size for t in stop_ids):
            raise BadRequest(f"stop_token_ids: ids must be in [0, {cfg.vocab_size})", "stop_token_ids")
        best_of = getattr(body, "best_of", None) or body.n
        for name, value in (("n", body.n), ("best_of", best_of)):
            if value > self.max_n:
                raise BadRequest(f"{name} ({value}) exceeds this server's limit of {self.max_n} (--max-n)", name)
        if best_of < body.n:
            raise BadRequest(f"best_of ({best_of}) must be at least n ({body.n})", "best_of")
        if best_of > body.n and body.stream:
            raise BadRequest(f"best_of ({best_of}) > n ({body.n}) cannot be streamed: the best are known at the end",
                             "best_of")
        if len(prompts) * best_of > MAX_CHOICES:
            raise BadRequest(f"{len(prompts)} prompts x {'best_of' if best_of > body.n else 'n'}={best_of} exceed "
                             f"{MAX_CHOICES} choices per request", "n")
        if max_tokens == 0 and not echo:
            raise BadRequest("max_tokens 0 needs echo: true (the prompt's own log-probs)" if hasattr(body, "echo")
                             else "max_tokens must be at least 1", "max_tokens")
        if body.min_tokens > max_tokens:
            raise BadRequest(f"min_tokens ({body.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
        bias = {}
        if getattr(body, "suffix", None):
            raise BadRequest("suffix is not supported: GPT-2 has no fill-in-the-middle (vLLM refuses it too)",
                             "suffix")
        for key, value in (body.logit_bias or {}).items():
            if not re.fullmatch(r"-?[0-9]+", key) or not 0 <= int(key) < cfg.vocab_size:  # ASCII digits only
                raise BadRequest(f"logit_bias: key {key!r} is not a token id in [0, {cfg.vocab_size})", "logit_bias")
            if not -100 <= value <= 100:
                raise BadRequest(f"logit_bias: value {value} for token {key} is outside [-100, 100]", "logit_bias")
            bias[int(key)] = value
        if longest + max_tokens > self.max_len:  # the prompt alone too long: it is what to shorten
            raise BadRequest(f"{what} + max_tokens ({max_tokens}) = {longest + max_tokens} exceeds {limit}",
                             source if longest >= self.max_len else "max_tokens", code="context_length_exceeded")
        # best_of: each token's log-prob ranks the candidates (the response shows them only if asked: want_lp)
        token_lp = 0 if best_of > body.n and logprobs is None else logprobs
        return [Sampling(max_new_tokens=max_tokens, temperature=body.temperature,
                         top_k=body.top_k if body.top_k > 0 else None, top_p=body.top_p if body.top_p < 1 else None,
                         seed=None if body.seed is None else body.seed + j, eos_token_id=cfg.eos_token_id, stop=stop,
                         stop_token_ids=stop_ids,
                         presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                         repetition_penalty=body.repetition_penalty, logit_bias=bias, min_tokens=body.min_tokens,
                         ignore_eos=body.ignore_eos, logprobs=token_lp, prompt_logprobs=echo and logprobs is not None)
                for _ in prompts for j in range(best_of)]

    def logprobs(self, ids: list, lps: list, tops: list, offsets: list, as_ids: bool = False) -> dict:
        """OpenAI's legacy logprobs object: tokens, token_logprobs, top_logprobs (the top ones and the chosen
        token), text_offset (`offsets`, from an Offsets of the choice). as_ids (and with no tokenizer): each
        token named 'token_id:N', as vLLM's return_tokens_as_token_ids."""
        d = (lambda t: f"token_id:{t[0]}") if as_ids or self.tok is None else self.tok.decode
        tops_out = []
        for t, lp, top in zip(ids, lps, tops):
            if lp is None:
                tops_out.append(None)
                continue
            entry = {}
            for i, v in zip(*top):  # two ids may decode alike (byte tokens' U+FFFD): the likelier keeps the key,
                entry.setdefault(d([i]), v)
            entry[d([t])] = lp  # but the chosen token's own: top_logprobs[i][tokens[i]] is token_logprobs[i]
            tops_out.append(entry)
        return {"tokens": [d([t]) for t in ids], "token_logprobs": list(lps), "top_logprobs": tops_out,
                "text_offset": list(offsets)}


class Offsets:
    """The text_offset of each token a choice shows: len(decode(ids[:i])), where its text starts in the choice's
    text. A tokenizer whose decoding is additive where a character ends (`additive`: byte-level, the tokens'
    bytes then UTF-8) decodes only the tokens since the last such place (an anchor, moved every WINDOW tokens
    to one whose text does not end in U+FFFD, half a character): O(WINDOW) a token, where decoding every
    prefix is O(n) a token and O(n^2) an answer. Any other tokenizer decodes the prefixes."""

    WINDOW = 16

    def __init__(self, tok):
        if tok is None:  # no tokenizer: every text is empty, so every token starts at 0
            self.decode, self.additive = (lambda ids: ""), True
        else:
            self.decode, self.additive = tok.decode, getattr(tok, "additive", False)
        self.anchor, self.base = 0, 0  # decode(ids[:anchor]) is base characters long and ends a character

    def of(self, ids: list, start: int = 0) -> list:
        """The offsets of ids[start:], ids the choice's shown ids so far (calls in order: start >= the last's)."""
        out = []
        for i in range(start, len(ids)):
            if not self.additive:
                out.append(len(self.decode(ids[:i])))
                continue
            window = self.decode(ids[self.anchor:i])
            out.append(self.base + len(window))
            if i - self.anchor >= self.WINDOW and not window.endswith("\ufffd"):
                self.anchor, self.base = i, self.base + len(window)
        return out


def load_template(path):
    """A chat template as HF's apply_chat_template runs one: a sandbox with raise_exception and strftime_now (HF
    templates call them: raise_exception checks the roles alternate). A template that does not parse is a
    Gpt2ffnError naming its line."""
    import datetime

    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    try:
        with open(path) as f:
            text = f.read()
        if not text.strip():  # every conversation would render as "" (one token: the empty prompt's start)
            raise Gpt2ffnError(f"--chat-template {path} is empty: give a Jinja template that renders the messages")
        return env.from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise Gpt2ffnError(f"--chat-template {path}: line {e.lineno}: {e.message}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise Gpt2ffnError(f"--chat-template {path}: cannot read it: {e}") from None


class Choices:
    """The choices of one API request as their Tokens arrive (prompt-major, best_of or n candidates per prompt),
    and the OpenAI objects made of them: the whole response, or its stream chunks."""

    def __init__(self, svc: Service, body, prompts: list, samplings: list, echo_text=None, chat=False):
        self.svc, self.chat, self.echo = svc, chat, echo_text
        self.id, self.created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        n = self.n = len(samplings)
        self.per_prompt, self.keep = n // len(prompts), body.n
        self.cumulative = [0.0] * n                # sum of the generated tokens' log-probs (ranks best_of)
        self.prompt_tokens = sum(len(p) for p in prompts)  # once per prompt, whatever n or best_of (as OpenAI, vLLM)
        self.want_lp = bool(body.logprobs) if chat else body.logprobs is not None
        no_tok = svc.tok is None
        self.want_ids = no_tok if body.return_token_ids is None else body.return_token_ids
        self.lp_ids = not chat and (no_tok if body.return_tokens_as_token_ids is None
                                    else body.return_tokens_as_token_ids)
        self.prompts = [prompts[c // self.per_prompt] for c in range(n)]
        self.sent_ids = [0] * n                    # generated ids a stream's chunks have carried
        self.id_chunks = [False] * n               # whether a chunk of choice c has gone out (with return_token_ids)
        self.include_usage = body.stream_options is not None and body.stream_options.include_usage
        self.texts, self.finish, self.started = [""] * n, [None] * n, [False] * n
        self.gen = [[] for _ in range(n)]          # generated ids
        self.shown = [[] for _ in range(n)]        # ids in the logprobs object: (echoed prompt +) generated
        self.lps = [[] for _ in range(n)]
        self.tops = [[] for _ in range(n)]
        self.streamed = [0] * n                    # entries of shown[c] a stream's chunks have carried
        self.offsets = [Offsets(svc.tok) for _ in range(n)] if self.want_lp and not chat else None  # text_offsets

    def collect(self, c: int, ev) -> str:
        """Take one Token of choice c; return the text it adds (the echoed prompt first, when asked)."""
        r, text = ev.request, ev.text
        if not self.started[c]:
            self.started[c] = True
            if self.echo:
                text = self.echo[c // self.per_prompt] + text
            if r.params.prompt_logprobs:  # echo: the prompt's own tokens and log-probs, first one null
                self.shown[c] = list(r.prompt)
                self.lps[c] = [lp for lp, _ in r.prompt_logprobs]
                self.tops[c] = [top for _, top in r.prompt_logprobs]
        if ev.id >= 0:
            self.cumulative[c] += ev.logprob or 0.0
            self.gen[c].append(ev.id)
            self.shown[c].append(ev.id)
            self.lps[c].append(ev.logprob)
            self.tops[c].append(ev.top)
        self.texts[c] += text
        if ev.finish_reason:
            self.finish[c] = ev.finish_reason
        return text

    def usage(self) -> dict:
        done = sum(len(i) for i in self.gen)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    def head(self, obj: str, choices: list, usage=None) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.svc.name, "choices": choices,
                **({"usage": usage} if usage else {})}

    def kept(self) -> list:
        """The candidates that come back: all of them, or with best_of > n, per prompt the n of highest
        cumulative log-prob, best first (as vLLM ranks them). Usage counts every candidate generated."""
        per = self.per_prompt
        if per == self.keep:
            return list(range(self.n))
        return [c for p in range(0, self.n, per)
                for c in sorted(range(p, p + per), key=lambda c: -self.cumulative[c])[:self.keep]]

    def response(self) -> dict:
        """The whole answer: a completion or a chat completion, with usage."""
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": self.texts[c]},
                        "logprobs": self.chat_logprobs(c) if self.want_lp else None,
                        "finish_reason": self.finish[c], **self.ids(c, prompt=False)}
                       for i, c in enumerate(self.kept())]
            return {**self.head("chat.completion", choices, self.usage()), **self.prompt_ids()}
        choices = [{"index": i, "text": self.texts[c], "finish_reason": self.finish[c],
                    "logprobs": self.svc.logprobs(self.shown[c], self.lps[c], self.tops[c],
                                                  Offsets(self.svc.tok).of(self.shown[c]), self.lp_ids)
                    if self.want_lp else None, **self.ids(c)}
                   for i, c in enumerate(self.kept())]
        return self.head("text_completion", choices, self.usage())

    def chat_logprobs(self, c: int, start: int = 0) -> dict:
        """OpenAI's chat logprobs of choice c's tokens from `start`: {content: [{token, logprob, bytes,
        top_logprobs: [{token, logprob, bytes}]}]}, of the raw distribution (as the completions' are)."""
        tok = self.svc.tok

        def entry(t, lp):
            raw = tok.token_bytes(t) if tok is not None else f"token_id:{t}".encode()
            return {"token": tok.decode([t]) if tok is not None else f"token_id:{t}", "logprob": lp,
                    "bytes": list(raw)}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in zip(*top)]}
                            for t, lp, top in zip(self.shown[c][start:], self.lps[c][start:], self.tops[c][start:])]}

    def ids(self, c: int, start: int = 0, prompt: bool = True) -> dict:
        """With return_token_ids: choice c's generated ids from `start` (and its prompt's ids), else nothing."""
        if not self.want_ids:
            return {}
        return {**({"prompt_token_ids": self.prompts[c]} if prompt else {}), "token_ids": self.gen[c][start:]}

    def prompt_ids(self) -> dict:
        """A chat answer's prompt_token_ids (the rendered conversation's), with return_token_ids."""
        return {"prompt_token_ids": self.prompts[0]} if self.want_ids else {}

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def chunks(self, items: list) -> list:
        """The stream chunks for (choice, Token) pairs that arrived together: one per choice, in the order they
        came, its tokens' text and log-probs joined (the first also the echoed prompt's, as the whole answer
        lists them); none for a choice whose tokens add nothing yet."""
        by_choice = {}
        for c, ev in items:
            by_choice.setdefault(c, []).append(ev)
        out = []
        for c, evs in by_choice.items():
            text = "".join(self.collect(c, ev) for ev in evs)
            lp, done = None, self.streamed[c]
            if self.chat and self.want_lp and len(self.shown[c]) > done:
                lp = self.chat_logprobs(c, done)
                self.streamed[c] = len(self.shown[c])
            elif self.want_lp and len(self.shown[c]) > done:  # offsets in the decoded ids shown before these
                lp = self.svc.logprobs(self.shown[c][done:], self.lps[c][done:], self.tops[c][done:],
                                       self.offsets[c].of(self.shown[c], done), self.lp_ids)
                self.streamed[c] = len(self.shown[c])
            finish = next((ev.finish_reason for ev in evs if ev.finish_reason), None)
            sent, new_ids = self.sent_ids[c], self.want_ids and len(self.gen[c]) > self.sent_ids[c]
            if not (text or lp or finish or new_ids):
                continue
            # with return_token_ids: the ids since the last chunk; a completion's first also its prompt's
            ids = self.ids(c, sent, prompt=not self.chat and not self.id_chunks[c])
            self.sent_ids[c], self.id_chunks[c] = len(self.gen[c]), True
            if self.chat:
                delta = {"index": c, "delta": {"content": text} if text or not finish else {},
                         **({"logprobs": lp} if self.want_lp else {}), "finish_reason": finish, **ids}
            else:
                delta = {"index": c, "text": text, "logprobs": lp, "finish_reason": finish, **ids}
            out.append(self.head(self.chunk_object, [delta]))
        return out

    def role_chunk(self) -> dict:
        """A chat stream's first chunk: each choice's role."""
        return {**self.head(self.chunk_object, [{"index": c, "delta": {"role": "assistant"}, "finish_reason": None}
                                                for c in range(self.n)]), **self.prompt_ids()}

    def usage_chunk(self) -> dict:
        return self.head(self.chunk_object, [], self.usage())
