"""Prometheus metrics of the server and its engine, through prometheus_client, named as vLLM names them."""

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    """One registry per server (tests create several apps in one process). With the engine in its own process
    (serving/core.py) each side keeps its part: the server its requests by status (server), the engine process the
    rest (engine); /metrics gives both."""

    def __init__(self, server: bool = True, engine: bool = True):
        self.registry = r = CollectorRegistry()
        self.engine = engine
        if server:
            self.requests = Counter("gpt2ffn_requests", "Completion requests by HTTP status.", ["code"], registry=r)
        if not engine:
            return
        self.cancelled = Counter("gpt2ffn_cancelled", "Requests stopped because the client went away.", registry=r)
        self.running = Gauge("gpt2ffn_num_requests_running", "Sequences in the running batch.", registry=r)
        self.waiting = Gauge("gpt2ffn_num_requests_waiting", "Requests waiting to be admitted.", registry=r)
        self.kv_blocks = Gauge("gpt2ffn_kv_cache_blocks_in_use", "Blocks of the paged KV cache in use.", registry=r)
        self.kv_usage = Gauge("gpt2ffn_kv_cache_usage_perc", "Fraction of the KV cache in use (0-1).", registry=r)
        self.prompt_tokens = Counter("gpt2ffn_prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("gpt2ffn_generation_tokens", "Tokens generated.", registry=r)
        self.batch = Histogram("gpt2ffn_batch_size", "Sequences decoded together per engine step.", registry=r,
                               buckets=(1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 256))
        self.ttft = Histogram("gpt2ffn_time_to_first_token_seconds", "From arrival to the first token.",
                              registry=r, buckets=LATENCY)
        self.itl = Histogram("gpt2ffn_inter_token_latency_seconds", "Between two tokens of one request.",
                             registry=r, buckets=LATENCY)
        self.e2e = Histogram("gpt2ffn_e2e_request_latency_seconds", "From arrival to the last token.",
                             registry=r, buckets=LATENCY)

    def counts(self, engine):
        if not self.engine:
            return
        running, waiting, blocks = engine.counts()
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_blocks.set(blocks)
        self.kv_usage.set(blocks / engine.cache.num_blocks)

    def step(self, engine, batch: int, events: list):
        """Called by Engine.step after each iteration."""
        self.counts(engine)
        if batch:
            self.batch.observe(batch)
        now, generated = time.perf_counter(), 0
        for ev in events:
            r = ev.request
            if ev.id >= 0:
                generated += 1
                if ev.gap is None:
                    self.ttft.observe(now - r.arrival)
                    self.prompt_tokens.inc(len(r.prompt))
                else:
                    self.itl.observe(ev.gap)
            if ev.finish_reason == "abort":
                self.cancelled.inc()
            elif ev.finish_reason is not None:
                self.e2e.observe(now - r.arrival)
        if generated:
            self.generation_tokens.inc(generated)

    def render(self) -> bytes:
        return generate_latest(self.registry)
