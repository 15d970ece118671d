"""The HTTP server as a user meets it: a subprocess on loopback, driven by the openai package, curl and raw HTTP."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from gpt2ffn.cli import main
from gpt2ffn.generate import Sampling, generate, load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`gpt2ffn serve` as a subprocess; cafile: it serves HTTPS (--ssl-certfile among extra) signed by that."""

    def __init__(self, model, *extra, env=None, cafile=None):
        self.port = free_port()
        self.url = f"{'https' if cafile else 'http'}://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "gpt2ffn.cli", "serve", "--model", str(model),
                                      "--port", str(self.port), *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=None if env is None else {**os.environ, **env})
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read()}")
            try:
                r = httpx.get(self.url + "/health", timeout=1, verify=cafile or True)
                if r.status_code == 200:
                    self.model = r.json()["model"]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server did not become healthy")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random HF checkpoint with a byte-level BPE tokenizer trained here."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt2ffn import Config
    from gpt2ffn.model import random_weights_
    d = tmp_path_factory.mktemp("served") / "tiny-gpt2"
    cfg = Config.from_name("tiny")
    random_weights_(GPT2LMHeadModel(GPT2Config(**cfg.to_hf_dict())), 0).save_pretrained(d)
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog. Hello world!"] * 40, vocab_size=320,
                            special_tokens=["<|endoftext|>"])  # id 0, the tiny config's EOS
    tok.save(str(d / "tokenizer.json"))
    from transformers import PreTrainedTokenizerFast  # tokenizer_config.json too, for AutoTokenizer (lm-eval)
    PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>").save_pretrained(d)
    return d


CHAT_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


# Each test of a server runs against both places the engine can run: a thread of the server's process and a
# process of its own (serve --engine-process, serving/core.py).
ENGINE = pytest.mark.parametrize("engine", ["off", "on"], ids=["engine-thread", "engine-process"])


@pytest.fixture(scope="module", params=["off", "on"], ids=["engine-thread", "engine-process"])
def server(model_dir, request):
    (model_dir.parent / "chat.jinja").write_text(CHAT_TEMPLATE)
    s = Server(model_dir, "--chat-template", str(model_dir.parent / "chat.jinja"), "--engine-process", request.param)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_health_models_openapi(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    models = httpx.get(server.url + "/v1/models").json()
    assert models["data"][0]["id"] == server.model == "tiny-gpt2"
    assert 0 < time.time() - models["data"][0]["created"] < 3600  # when it was loaded (it was 0)
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "/v1/completions" in spec["paths"]
    # the spec documents what comes back, not only what goes in: responses and errors have their schemas
    post = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert post["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Completion"}
    assert post["400"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    schemas = spec["components"]["schemas"]
    assert {"choices", "usage", "model"} <= set(schemas["Completion"]["properties"])
    assert {"tokens", "token_logprobs", "top_logprobs", "text_offset"} <= set(schemas["Logprobs"]["properties"])
    for path in ("/v1/chat/completions", "/v1/models", "/health", "/tokenize", "/detokenize"):
        ok = spec["paths"][path][next(iter(spec["paths"][path]))]["responses"]["200"]
        assert "$ref" in ok["content"]["application/json"]["schema"], path


def test_openai_client_greedy_equals_in_process(client, server, model_dir):
    r = client.completions.create(model=server.model, prompt="the quick brown", max_tokens=12, temperature=0)
    model, tok, _ = load(str(model_dir))
    ids = tok.encode("the quick brown")
    expected = generate(model, [ids], Sampling(max_new_tokens=12, eos_token_id=model.config.eos_token_id))[0]
    assert r.choices[0].text == tok.decode([t for t in expected if t != model.config.eos_token_id])
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(expected)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason in ("length", "stop") and r.object == "text_completion"


def test_openai_client_streaming_equals_whole(client, server):
    whole = client.completions.create(model=server.model, prompt="Hello", max_tokens=20, temperature=0)
    parts, finish = [], None
    for chunk in client.completions.create(model=server.model, prompt="Hello", max_tokens=20, temperature=0,
                                           stream=True):
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == whole.choices[0].text and finish == whole.choices[0].finish_reason


def test_stream_interval_sends_fewer_chunks_of_the_same_text(model_dir, client, server):
    """`serve --stream-interval 4`: after the first chunk at least 4 tokens a chunk (but the last); the same text
    and finish as the whole answer of a server that streams every token. (Exact chunking: test_serving.py.)"""
    whole = client.completions.create(model=server.model, prompt="Hello", max_tokens=13, temperature=0,
                                      extra_body={"ignore_eos": True})
    s = Server(model_dir, "--stream-interval", "4")
    try:
        body = {"model": s.model, "prompt": "Hello", "max_tokens": 13, "temperature": 0, "stream": True,
                "ignore_eos": True, "return_token_ids": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        from openai import OpenAI  # the openai client reads the same stream
        parts = [c.choices[0].text for c in OpenAI(base_url=s.url + "/v1", api_key="none").completions.create(
            model=s.model, prompt="Hello", max_tokens=13, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if c.choices]
    finally:
        s.stop()
    sizes = [len(c["choices"][0]["token_ids"]) for c in chunks]  # more a chunk where the loop fell behind
    assert sum(sizes) == 13 and all(n >= 4 for n in sizes[1:-1]), sizes
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(parts) == whole.choices[0].text
    assert chunks[-1]["choices"][0]["finish_reason"] == whole.choices[0].finish_reason == "length"


def test_prompt_list_seed_and_stop(client, server):
    r = client.completions.create(model=server.model, prompt=["the lazy", "Hello"], max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    a = client.completions.create(model=server.model, prompt="dog", max_tokens=16, temperature=1.0, seed=5)
    b = client.completions.create(model=server.model, prompt="dog", max_tokens=16, temperature=1.0, seed=5)
    assert a.choices[0].text == b.choices[0].text
    free = client.completions.create(model=server.model, prompt="dog", max_tokens=30, temperature=0).choices[0].text
    assert len(free) > 3, free
    stop = free[2:4]
    cut = client.completions.create(model=server.model, prompt="dog", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == free[:free.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_curl(server):
    if not shutil.which("curl"):
        pytest.skip("curl is not installed")
    body = json.dumps({"model": server.model, "prompt": "Hello", "max_tokens": 5, "temperature": 0})
    out = subprocess.run(["curl", "-s", server.url + "/v1/completions", "-H", "Content-Type: application/json",
                          "-d", body], capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["usage"]["completion_tokens"] <= 5
    out = subprocess.run(["curl", "-sN", server.url + "/v1/completions", "-H", "Content-Type: application/json",
                          "-d", json.dumps({**json.loads(body), "stream": True})],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("data: [DONE]")


@pytest.mark.parametrize("body, status, param, text", [
    ('{"model": "tiny-gpt2", "prompt": "hi", ', 400, None, "not valid JSON"),
    ({"model": "tiny-gpt2", "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ({"model": "tiny-gpt2", "prompt": "hi", "temperature": 5}, 400, "temperature", "less than or equal to 2"),
    ({"model": "tiny-gpt2", "prompt": "hi", "top_p": 0}, 400, "top_p", "greater than 0"),
    ({"model": "tiny-gpt2", "prompt": 42}, 400, "prompt", ""),
    ({"model": "tiny-gpt2", "prompt": "hi", "logprobs": 6}, 400, "logprobs", "less than or equal to 5"),
    ({"model": "tiny-gpt2", "prompt": "hi", "best_of": 0}, 400, "best_of", "greater than or equal to 1"),
    ({"model": "tiny-gpt2", "prompt": "hi", "best_of_": 3}, 400, "best_of_", "Extra inputs"),
    ({"model": "tiny-gpt2", "prompt": "hi", "logprobs": -1}, 400, "logprobs", "greater than or equal to 0"),
    ({"model": "tiny-gpt2", "prompt": "hi", "echo": "maybe"}, 400, "echo", "boolean"),
    ({"model": "tiny-gpt2", "prompt": "hi", "n": 0}, 400, "n", "greater than or equal to 1"),
    ({"model": "tiny-gpt2", "prompt": ["a"] * 20, "n": 8}, 400, "n", "exceed 128 choices"),
    ({"model": "tiny-gpt2", "prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty", "less than or equal to 2"),
    ({"model": "tiny-gpt2", "prompt": "hi", "frequency_penalty": -2.5}, 400, "frequency_penalty", "greater than"),
    ({"model": "tiny-gpt2", "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", "greater than 0"),
    ({"model": "tiny-gpt2", "prompt": "hi", "top_k": -2}, 400, "top_k", "greater than or equal to -1"),
    ({"model": "tiny-gpt2", "prompt": "hi", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens",
     "exceeds max_tokens"),
    ({"model": "tiny-gpt2", "prompt": "hi", "ignore_eos": "x"}, 400, "ignore_eos", "boolean"),
    ({"model": "tiny-gpt2", "prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias", "not a token id"),
    ({"model": "tiny-gpt2", "prompt": "hi", "logit_bias": {"5000": 1}}, 400, "logit_bias", "not a token id"),
    ({"model": "tiny-gpt2", "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias", "outside [-100, 100]"),
    ({"model": "tiny-gpt2", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "needs echo"),
    ({"model": "tiny-gpt2", "prompt": [1, 2, 9999]}, 400, "prompt", "outside this model's vocabulary"),
    ({"model": "tiny-gpt2", "prompt": [[1, 2], []]}, 400, "prompt", "must not be empty"),
    ({"model": "tiny-gpt2", "prompt": []}, 400, "prompt", "must not be an empty list"),
    ({"model": "tiny-gpt2", "prompt": [1.5]}, 400, "prompt", ""),
    ({"model": "tiny-gpt2", "prompt": "hi", "max_tokens": 1000}, 400, "max_tokens",
     "exceeds the model's context of 128"),
    ({"model": "tiny-gpt2", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "up to 4"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model", "does not exist"),
    ({"model": 5, "prompt": "hi"}, 400, "model", "valid string"),  # left out: the served model (below)
    # strict types, as OpenAI's API checks them (pydantic's lax mode took "10" as 10 and true as token id 1)
    ({"model": "tiny-gpt2", "prompt": "hi", "max_tokens": "10"}, 400, "max_tokens", "valid integer"),
    ({"model": "tiny-gpt2", "prompt": "hi", "stream": "true"}, 400, "stream", "valid boolean"),
    ({"model": "tiny-gpt2", "prompt": [True, False]}, 400, "prompt", "must be a string, a list of strings, a list of "
                                                                      "token ids, or a list of token-id lists"),
    ({"model": "tiny-gpt2", "prompt": ["a", 5]}, 400, "prompt", "must be a string, a list of strings"),
    # fields OpenAI or vLLM document, at a value that would change the answer: refused by name, saying why
    ({"model": "tiny-gpt2", "prompt": "hi", "tools": [{"type": "function"}]}, 400, "tools", "no tool calling"),
    ({"model": "tiny-gpt2", "prompt": "hi", "min_p": 0.1}, 400, "min_p", "min_p is not supported"),
    ({"model": "tiny-gpt2", "prompt": "hi", "reasoning_effort": "low"}, 400, "reasoning_effort", "not a reasoning"),
    ({"model": "tiny-gpt2", "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "only allowed with stream: true"),
    ({"model": "tiny-gpt2", "prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}},
     400, "stream_options.continuous_usage_stats", "not supported"),
    ({"model": "tiny-gpt2", "prompt": "hi", "n_predict": 3, "max_tokens": 3}, 400, None, "not both"),
    ({"model": "tiny-gpt2", "prompt": "hi", "frobnicate": 1}, 400, "frobnicate", "Extra inputs"),  # unknown: refused
    ({"model": "tiny-gpt2", "prompt": [1] * 128, "max_tokens": 4}, 400, "prompt", "exceeds the model's context"),
    ({"model": "tiny-gpt2", "prompt": [1] * 128}, 400, "prompt", "leaves no room for a new token"),
    ("", 400, None, "the request body is empty: send a JSON object"),
    ('{"model": "tiny-gpt2", "prompt": "hi", "temperature": NaN}', 400, "temperature", "finite number"),
])
def test_bad_input_gets_openai_errors(server, body, status, param, text):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + "/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and text in err["message"]
    assert param is None or (err["param"] or "").startswith(param)
    assert httpx.get(server.url + "/health").status_code == 200


def test_documented_fields_that_change_nothing_are_taken(server):
    """OpenAI's store / metadata / service_tier / tools: [] / tool_choice "none", vLLM's min_p 0 and
    skip_special_tokens, null for any of them, and llama-server's n_predict and repeat_penalty (its names of
    max_tokens and repetition_penalty) give the answer given without them."""
    base = {"model": server.model, "prompt": "the quick", "max_tokens": 6, "temperature": 0}
    want = httpx.post(server.url + "/v1/completions", json=base).json()["choices"][0]["text"]
    extra = {"store": False, "metadata": {"a": "b"}, "service_tier": "auto", "tools": [], "tool_choice": "none",
             "min_p": 0, "skip_special_tokens": True, "prediction": None, "user": "u", "add_special_tokens": True,
             "response_format": {"type": "text"}}
    r = httpx.post(server.url + "/v1/completions", json={**base, **extra})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
    penalized = httpx.post(server.url + "/v1/completions", json={**base, "repetition_penalty": 1.3}).json()
    llama = {**{k: v for k, v in base.items() if k != "max_tokens"}, "n_predict": 6, "repeat_penalty": 1.3}
    got = httpx.post(server.url + "/v1/completions", json=llama).json()
    assert got["choices"][0]["text"] == penalized["choices"][0]["text"] and got["usage"] == penalized["usage"]
    for extra in ({"n_predict": None}, {"n_predict": -1, "max_tokens": None}, {"priority": 0.0},  # -1: no limit
                  {"stream": True, "stream_options": {"include_usage": False, "include_obfuscation": False}}):
        r = httpx.post(server.url + "/v1/completions", json={**base, **extra})
        assert r.status_code == 200, (extra, r.text)
    for route, body in (("completions", {k: v for k, v in base.items() if k != "model"}),  # no model: the served
                        ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
        r = httpx.post(f"{server.url}/v1/{route}", json=body)  # one, as vLLM and llama-server take it (was a 400)
        assert r.status_code == 200 and r.json()["model"] == server.model, r.text
    assert httpx.post(server.url + "/v1/completions", json={**base, "model": "other"}).status_code == 404


@pytest.mark.parametrize("content, said", [
    (b'{"model": "m", "prompt": "\xff\xfe"}', "not UTF-8 text (byte 0xff at offset 26)"),
    (b"[" * 100000 + b"]" * 100000, "nests arrays or objects too deeply"),
])
def test_a_body_that_cannot_be_parsed_says_why(server, content, said):
    r = httpx.post(server.url + "/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and said in r.json()["error"]["message"], r.text


def refused(server, code: int) -> float:
    """gpt2ffn_requests_total{code=...} as /metrics says it now (0 before the first)."""
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(f'gpt2ffn_requests_total{{code="{code}"}} '):
            return float(line.split()[-1])
    return 0.0


def test_oversized_body_is_413(server):
    before = refused(server, 413)
    r = httpx.post(server.url + "/v1/completions", content=b"x" * (2 << 20),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert refused(server, 413) == before + 1  # counted, as every refused request is


def test_a_chunked_body_is_held_to_the_same_limit(server):
    """No Content-Length (Transfer-Encoding: chunked): over the limit 413 after reading just past it; under it
    the body arrives whole, in however many chunks it was sent."""
    def chunks(total, size=64 << 10):
        for i in range(0, total, size):
            yield b"x" * min(size, total - i)

    before = refused(server, 413)
    r = httpx.post(server.url + "/v1/completions", content=chunks(64 << 20),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert refused(server, 413) == before + 1
    body = json.dumps({"model": server.model, "prompt": "dog", "max_tokens": 3}).encode()
    r = httpx.post(server.url + "/v1/completions", content=(body[i:i + 7] for i in range(0, len(body), 7)),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_concurrent_clients_and_metrics(server):
    results = []

    def one(i):
        r = httpx.post(server.url + "/v1/completions", json={"model": server.model, "prompt": f"fox {i}",
                                                               "max_tokens": 10}, timeout=60)
        results.append(r.status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 12
    metrics = httpx.get(server.url + "/metrics").text
    assert 'gpt2ffn_requests_total{code="200"}' in metrics and "gpt2ffn_num_requests_running 0.0" in metrics
    assert "gpt2ffn_e2e_request_latency_seconds_bucket" in metrics


def test_schemathesis_finds_no_5xx(server):
    st = shutil.which("schemathesis") or os.path.join(os.path.dirname(sys.executable), "schemathesis")
    if not os.path.exists(st):
        pytest.skip("schemathesis is not installed")
    # --request-timeout: a chat request without max_tokens generates up to the whole context, which on a busy
    # 2-core machine can pass schemathesis's default of 10 s (a client timeout, not a server error)
    r = subprocess.run([st, "run", server.url + "/openapi.json", "--checks", "not_a_server_error",
                        "--max-examples", "40", "--request-timeout", "60", "--no-color"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


@pytest.fixture(scope="module", params=["off", "on"], ids=["engine-thread", "engine-process"])
def slow_server(request):
    """gpt2-sized random weights, one running sequence and two waiting: the third concurrent request waits,
    the fourth is refused."""
    s = Server("random:gpt2", "--max-batch", "1", "--max-waiting", "2", "--engine-process", request.param)
    yield s
    s.stop()


def test_full_queue_is_503_with_retry_after(slow_server):
    codes, headers = [], []

    def one(stream):
        r = httpx.post(slow_server.url + "/v1/completions",
                       json={"model": slow_server.model, "prompt": "x", "max_tokens": 40, "stream": stream},
                       timeout=120)
        codes.append(r.status_code)
        headers.append(r.headers.get("retry-after"))

    threads = [threading.Thread(target=one, args=(i % 2 == 1,)) for i in range(6)]  # streamed ones too
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert codes.count(503) == 3 and codes.count(200) == 3  # 1 running + 2 waiting; the rest refused at once
    assert all(h == "1" for c, h in zip(codes, headers) if c == 503)
    # More sequences at once than it holds (3) is a 400 naming the field to lower: n, or the prompt list.
    for body, param in (({"prompt": "x", "n": 4}, "n"), ({"prompt": ["x"] * 4}, "prompt"),
                        ({"prompt": "x", "best_of": 4}, "best_of")):
        r = httpx.post(slow_server.url + "/v1/completions", json={"model": slow_server.model, "max_tokens": 1, **body})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param, err
        assert err["message"] == ("4 sequences at once exceed what this server holds: 1 running (max batch) + 2 "
                                  "waiting (max waiting)")


def test_disconnect_stops_generation(slow_server):
    """A client that leaves mid-stream: its request is cancelled (the engine frees it) and counted as a 499."""
    before = httpx.get(slow_server.url + "/metrics").text
    def metric(text, name):
        return float(next((line for line in text.splitlines() if line.startswith(name + " ")), "x 0").split()[1])

    def cancelled(text):
        return metric(text, "gpt2ffn_cancelled_total")

    with httpx.stream("POST", slow_server.url + "/v1/completions", timeout=60,
                      json={"model": slow_server.model, "prompt": "x", "max_tokens": 900, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    deadline = time.time() + 10
    while time.time() < deadline:
        text = httpx.get(slow_server.url + "/metrics").text
        if cancelled(text) > cancelled(before) and "gpt2ffn_num_requests_running 0.0" in text:
            code = 'gpt2ffn_requests_total{code="499"}'
            assert metric(text, code) == metric(before, code) + 1
            return
        time.sleep(0.1)
    pytest.fail("generation went on after the client disconnected")


@ENGINE
def test_sigterm_drains_in_flight(model_dir, engine):
    s = Server("random:gpt2", "--max-batch", "4", "--engine-process", engine)
    lines = []
    with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                      json={"model": s.model, "prompt": "x", "max_tokens": 40, "stream": True}) as r:
        for line in r.iter_lines():
            if line and not lines:
                s.proc.send_signal(signal.SIGTERM)
            if line:
                lines.append(line)
    assert lines[-1] == "data: [DONE]"
    assert s.proc.wait(30) == 0


def stream_until_signals(s, *signals, max_tokens=1000):
    """A long stream; at its first line the signals, 1 s apart. -> (its data lines, the server's exit status)."""
    lines = []
    with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                      json={"model": s.model, "prompt": "x", "max_tokens": max_tokens, "stream": True}) as r:
        for line in r.iter_lines():
            if line and not lines:
                for i, sig in enumerate(signals):
                    time.sleep(i and 1)
                    s.proc.send_signal(sig)
            if line:
                lines.append(line)
    return lines, s.proc.wait(30)


@ENGINE
def test_a_stream_past_the_shutdown_timeout_ends_with_an_error_event(model_dir, engine):
    """SIGTERM with a stream that outlives --shutdown-timeout: the stream gets an error event saying why, and
    closes properly (it was cut mid-chunk by uvicorn's own 60 s timeout, an incomplete chunked read); exit 0."""
    s = Server("random:gpt2", "--max-batch", "4", "--shutdown-timeout", "1", "--engine-process", engine)
    lines, code = stream_until_signals(s, signal.SIGTERM)
    error = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert error["message"].startswith("the server is shutting down (requests still running after "
                                       "--shutdown-timeout 1 s)"), error
    assert len(lines) > 2 and code == 0


@ENGINE
def test_a_second_ctrl_c_ends_streams_with_an_error_and_no_abort(model_dir, engine):
    """Ctrl-C twice with a stream running: the stream ends with an error event, the process with 130 (SIGINT),
    no traceback, no C++ abort (it was SIGABRT: the engine thread was killed inside native code at exit)."""
    s = Server("random:gpt2", "--max-batch", "4", "--engine-process", engine)
    lines, code = stream_until_signals(s, signal.SIGINT, signal.SIGINT)
    err = s.proc.stderr.read() + s.proc.stdout.read()
    assert "a second interrupt" in lines[-1] and code == 130, (lines[-1], code)
    assert "Traceback" not in err and "terminate called" not in err, err


def post(server, **body):
    r = httpx.post(server.url + "/v1/completions", json={"model": server.model, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_concurrent_greedy_and_seeded_equal_alone(server):
    """16 clients at once, greedy and seeded: each gets what it got alone."""
    bodies = [dict(prompt=f"the {w} fox {i}", max_tokens=16, temperature=0) for i, w in
              enumerate(["quick", "lazy", "brown", "dog"] * 2)]
    bodies += [dict(prompt=f"Hello {w} {i}", max_tokens=16, temperature=1.0, top_p=0.9, seed=i) for i, w in
               enumerate(["world", "jumps", "over", "the"] * 2)]
    solo = [post(server, **b)["choices"][0]["text"] for b in bodies]
    together = [None] * len(bodies)

    def one(i):
        together[i] = post(server, **bodies[i])["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == solo
    assert len(set(solo[8:])) > 1  # the seeds differ, so do the texts


def test_prompt_shapes_and_n(server, model_dir):
    _, tok, _ = load(str(model_dir))
    ids = tok.encode("the quick brown")
    text = post(server, prompt="the quick brown", max_tokens=8, temperature=0)["choices"][0]["text"]
    assert post(server, prompt=ids, max_tokens=8, temperature=0)["choices"][0]["text"] == text
    r = post(server, prompt=[ids, tok.encode("Hello")], max_tokens=8, temperature=0, n=2)
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["choices"][0]["text"] == r["choices"][1]["text"] == text
    r = post(server, prompt="dog", max_tokens=12, temperature=1.0, seed=3, n=2)
    assert r["choices"][0]["text"] == post(server, prompt="dog", max_tokens=12, temperature=1.0,
                                           seed=3)["choices"][0]["text"]
    assert r["choices"][1]["text"] == post(server, prompt="dog", max_tokens=12, temperature=1.0,
                                           seed=4)["choices"][0]["text"]
    assert r["usage"]["prompt_tokens"] == len(tok.encode("dog"))  # once per prompt, whatever n (OpenAI, vLLM)


def test_echo_and_logprobs_equal_hf_log_softmax(server, model_dir):
    import torch
    from transformers import GPT2LMHeadModel
    model, tok, _ = load(str(model_dir))
    hf = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    ids = tok.encode("the quick brown fox jumps over")
    full = ids + generate(model, [ids], Sampling(max_new_tokens=4))[0]
    r = post(server, prompt=ids, max_tokens=4, temperature=0, echo=True, logprobs=2, ignore_eos=True)
    c = r["choices"][0]
    lp = c["logprobs"]
    assert c["text"].startswith(tok.decode(ids)) and len(lp["tokens"]) == len(ids) + 4
    assert lp["tokens"] == [tok.decode([t]) for t in full]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].double(), -1)
    expected = [ref[i - 1, full[i]].item() for i in range(1, len(full))]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(expected, abs=1e-4)
    for i in range(1, len(full)):
        top = lp["top_logprobs"][i]
        best = ref[i - 1].topk(2)
        # keys: the top 2 and the chosen token, as text; ids that decode alike (a partial UTF-8 byte is '')
        # share one key, as in OpenAI's format
        assert set(top) == {tok.decode([t]) for t in best.indices.tolist() + [full[i]]}
        assert max(top.values()) == pytest.approx(best.values[0].item(), abs=1e-4)
    assert "".join(lp["tokens"]) == c["text"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(full))]
    # max_tokens 0: the prompt alone (what lm-eval's loglikelihood needs), usage counts no completion tokens
    r0 = post(server, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert r0["choices"][0]["text"] == tok.decode(ids) and r0["usage"]["completion_tokens"] == 0
    assert r0["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:len(ids)]
    # no echo: the generated tokens only
    r1 = post(server, prompt=ids, max_tokens=4, temperature=0, logprobs=1, ignore_eos=True)
    assert r1["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(expected[len(ids) - 1:], abs=1e-4)


def test_streamed_text_offsets_equal_the_whole_answers(server):
    """With a stop string the stream holds back text that could start one; its chunks' text_offset still count
    in the whole answer's text (as the answer without streaming gives them)."""
    body = dict(prompt="Hello", max_tokens=12, temperature=0, logprobs=1, stop=["\n\n\n"], ignore_eos=True)
    whole = post(server, **body)["choices"][0]["logprobs"]
    chunks = [json.loads(line[6:]) for line in httpx.post(
        server.url + "/v1/completions", timeout=60, json={"model": server.model, "stream": True, **body}
    ).text.splitlines() if line.startswith("data: {")]
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert sum((lp["text_offset"] for lp in lps), []) == whole["text_offset"]
    assert sum((lp["tokens"] for lp in lps), []) == whole["tokens"]


def test_streaming_logprobs_and_echo(server):
    chunks = [json.loads(line[6:]) for line in httpx.post(
        server.url + "/v1/completions", timeout=60, json={"model": server.model, "prompt": "Hello", "max_tokens": 6,
                                                          "temperature": 0, "stream": True, "logprobs": 1,
                                                          "echo": True, "ignore_eos": True}).text.splitlines()
              if line.startswith("data: {")]
    whole = post(server, prompt="Hello", max_tokens=6, temperature=0, echo=True, ignore_eos=True, logprobs=1)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):  # the prompt's first, as the whole's
        assert sum((lp[key] for lp in lps), []) == whole["choices"][0]["logprobs"][key], key
    assert len(whole["choices"][0]["logprobs"]["tokens"]) > 6


def test_tokenize_detokenize(server, model_dir):
    _, tok, _ = load(str(model_dir))
    r = httpx.post(server.url + "/tokenize", json={"model": server.model, "prompt": "the lazy dog"}).json()
    assert r["tokens"] == tok.encode("the lazy dog") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 128
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "the lazy dog"
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [99999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def stream_chunks(server, **body) -> list:
    """The chunks of a streamed completion, as dicts."""
    with httpx.stream("POST", server.url + "/v1/completions", json={"model": server.model, "stream": True, **body},
                      timeout=120) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_return_token_ids_and_tokens_as_ids(server, client, model_dir):
    """vLLM's return_token_ids: each choice's prompt ids and generated ids, the ones its text is made of (a
    stream: the generated ids chunk by chunk, the prompt's in a choice's first); without it no such keys.
    return_tokens_as_token_ids names logprobs' tokens 'token_id:N'."""
    _, tok, _ = load(str(model_dir))
    plain = post(server, prompt="the quick", max_tokens=8, temperature=0)["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    r = post(server, prompt=["the quick", "Hello"], max_tokens=8, temperature=0, ignore_eos=True,
             return_token_ids=True)
    for choice, prompt in zip(r["choices"], ["the quick", "Hello"]):
        assert choice["prompt_token_ids"] == tok.encode(prompt) and len(choice["token_ids"]) == 8
        assert tok.decode(choice["token_ids"]) == choice["text"]
    chunks = stream_chunks(server, prompt="the quick", max_tokens=8, temperature=0, ignore_eos=True,
                           return_token_ids=True)
    firsts = [c["choices"][0] for c in chunks if "prompt_token_ids" in c["choices"][0]]
    assert len(firsts) == 1 and firsts[0]["prompt_token_ids"] == tok.encode("the quick")
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == r["choices"][0]["token_ids"]
    lp = post(server, prompt="the quick", max_tokens=4, temperature=0, ignore_eos=True, logprobs=2,
              return_tokens_as_token_ids=True, return_token_ids=True)["choices"][0]
    assert lp["logprobs"]["tokens"] == [f"token_id:{t}" for t in lp["token_ids"]]
    assert all(k.startswith("token_id:") for top in lp["logprobs"]["top_logprobs"] for k in top)
    # the openai package hands the extra fields through
    got = client.completions.create(model=server.model, prompt="the quick", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    assert got.choices[0].token_ids == r["choices"][0]["token_ids"]


def test_stop_token_ids(server):
    """vLLM's stop_token_ids: the answer ends at the first such id, which it keeps; min_tokens holds it off."""
    free = post(server, prompt="the quick", max_tokens=20, temperature=0, ignore_eos=True,
                return_token_ids=True)["choices"][0]["token_ids"]
    i = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    cut = post(server, prompt="the quick", max_tokens=20, temperature=0, ignore_eos=True, return_token_ids=True,
               stop_token_ids=[free[i]])["choices"][0]
    assert cut["token_ids"] == free[:i + 1] and cut["finish_reason"] == "stop"
    held = post(server, prompt="the quick", max_tokens=20, temperature=0, ignore_eos=True, return_token_ids=True,
                stop_token_ids=[free[i]], min_tokens=i + 2)["choices"][0]
    assert free[i] not in held["token_ids"][:i + 2]
    bad = httpx.post(server.url + "/v1/completions", json={"model": server.model, "prompt": "a",
                                                           "stop_token_ids": [99999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids"


def test_chat_with_template(client, server, model_dir):
    _, tok, _ = load(str(model_dir))
    messages = [{"role": "user", "content": "the quick brown fox"}]
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=0)
    prompt = "user: the quick brown fox\nassistant:"
    expected = post(server, prompt=prompt, max_tokens=8, temperature=0)["choices"][0]["text"]
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=8, temperature=0, stream=True) if c.choices]
    assert "".join(parts) == expected
    # vLLM's add_generation_prompt: false renders no assistant prefix; OpenAI's fields at neutral values are taken
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=0,
                                       store=False, tools=[], tool_choice="none",
                                       extra_body={"add_generation_prompt": False})
    plain = post(server, prompt="user: the quick brown fox\n", max_tokens=8, temperature=0)["choices"][0]["text"]
    assert r.choices[0].message.content == plain != expected


def test_chat_without_template_names_completions(slow_server):
    r = httpx.post(slow_server.url + "/v1/chat/completions",
                   json={"model": slow_server.model, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "/v1/completions" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, param, text", [
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"role": "user"}]}, "messages.0.content", "Field required"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens",
     "greater than or equal to 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content", "must be a string or a list of text parts"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools", "no tool calling"),
])
def test_chat_bad_input(server, body, param, text):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": server.model, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and text in r.json()["error"]["message"]


def test_metrics_are_vllm_named(server):
    post(server, prompt="fox", max_tokens=4)
    text = httpx.get(server.url + "/metrics").text
    for name in ["gpt2ffn_num_requests_running", "gpt2ffn_num_requests_waiting", "gpt2ffn_kv_cache_usage_perc",
                 "gpt2ffn_time_to_first_token_seconds_bucket", "gpt2ffn_inter_token_latency_seconds_bucket",
                 "gpt2ffn_e2e_request_latency_seconds_count", "gpt2ffn_batch_size_bucket",
                 "gpt2ffn_prompt_tokens_total", "gpt2ffn_generation_tokens_total", "gpt2ffn_kv_cache_blocks_in_use"]:
        assert f"\n{name}" in text, name
    # one family per name, parsed by prometheus_client's own parser (the engine process's part is appended)
    from prometheus_client.parser import text_string_to_metric_families
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names)) and "gpt2ffn_requests" in names and "gpt2ffn_batch_size" in names


LM_EVAL_DOCS = [{"context": "the quick brown", "choices": [" fox", " dog", " world"], "label": 0, "answer": "x"},
                {"context": "Hello", "choices": [" world", " lazy"], "label": 0, "answer": "x"},
                {"context": "the lazy dog jumps over the", "choices": [" quick", " fox jumps"], "label": 1,
                 "answer": "x"}]


def lm_eval_tasks(d):
    """Two tasks on a local JSON dataset: multiple choice (loglikelihood) and generate_until."""
    data = d / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in LM_EVAL_DOCS))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
              "doc_to_text: \"{{context}}\"\n")
    (d / "mc.yaml").write_text("task: gpt2ffn_mc\n" + common + "output_type: multiple_choice\n"
                               "doc_to_choice: \"{{choices}}\"\ndoc_to_target: label\n"
                               "metric_list:\n  - metric: acc\n")
    (d / "gen.yaml").write_text("task: gpt2ffn_gen\n" + common + "output_type: generate_until\n"
                                "doc_to_target: \"{{answer}}\"\ngeneration_kwargs:\n  until: [\".\"]\n"
                                "  max_gen_toks: 12\n  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    return ["gpt2ffn_mc", "gpt2ffn_gen"]


_LM_EVAL_HF = {}  # model_dir -> HF's own answers to lm_eval_tasks, the same for both engine modes


def test_lm_eval_local_completions_equals_hf(server, model_dir, tmp_path, monkeypatch):
    """lm-evaluation-harness through the server gives HF's own loglikelihoods (1e-3) and greedy generations."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = lm_eval_tasks(tmp_path)
    # only our two tasks: indexing lm-eval's own few thousand took 15-19 s of this test, each time
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)

    def run(model, args):
        out = lm_eval.simple_evaluate(model=model, model_args=args, tasks=tasks, task_manager=manager,
                                      log_samples=True, batch_size=1)
        return {t: [s["resps"] for s in sorted(out["samples"][t], key=lambda s: s["doc_id"])] for t in tasks}

    ours = run("local-completions", f"model={server.model},base_url={server.url}/v1/completions,"
                                    f"tokenizer_backend=huggingface,tokenizer={model_dir},max_length=128")
    if model_dir not in _LM_EVAL_HF:
        _LM_EVAL_HF[model_dir] = run("hf", f"pretrained={model_dir},dtype=float32,device=cpu")
    hf = _LM_EVAL_HF[model_dir]
    lls = [(float(a[0][0]), float(b[0][0])) for x, y in zip(ours["gpt2ffn_mc"], hf["gpt2ffn_mc"]) for a, b in zip(x, y)]
    assert len(lls) == 7 and all(abs(a - b) < 1e-3 for a, b in lls), lls
    assert ours["gpt2ffn_gen"] == hf["gpt2ffn_gen"]


def test_serve_precision_answers_as_the_model_in_process(model_dir):
    """`serve --precision int8` serves the int8 model: the prompt's log-probs equal load(..., precision="int8")'s
    run over a KV cache of its kv_dtype (fp16: the prompt's keys are read back from it) and differ from fp32's (so
    the flag cannot be silently ignored)."""
    import torch

    from gpt2ffn.serving.kv_cache import KVCache
    tok = load(str(model_dir))[1]
    ids = tok.encode("the quick brown fox jumps")

    def logprobs(precision):
        m = load(str(model_dir), precision=precision)[0]
        with torch.no_grad():
            lp = torch.log_softmax(m(torch.tensor([ids]), KVCache(m.config, 1, m.kv_dtype))[0].double(), -1)
        return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    s = Server(model_dir, "--precision", "int8")
    try:
        r = httpx.post(s.url + "/v1/completions", json={"model": s.model, "prompt": ids, "max_tokens": 0,
                                                         "echo": True, "logprobs": 0}, timeout=60).json()
    finally:
        s.stop()
    assert "(int8 weights), ready" in s.proc.stdout.read()  # said so (the embeddings' float32 was)
    got = r["choices"][0]["logprobs"]["token_logprobs"][1:]
    assert got == pytest.approx(logprobs("int8"), abs=1e-4)
    assert got != pytest.approx(logprobs("fp32"), abs=1e-4)


# -- beyond localhost: API keys, TLS, limits ---------------------------------------------------------------
KEYS = ("sk-first-key", "sk-second-key")


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    """A self-signed certificate for localhost and 127.0.0.1 (openssl), and its key."""
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem")], check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


@pytest.fixture(scope="module")
def secure(model_dir, cert):
    """HTTPS, two API keys, prompt + max_tokens <= 64, n and best_of <= 3."""
    s = Server(model_dir, "--api-key", KEYS[0], "--api-key", KEYS[1], "--ssl-certfile", str(cert[0]),
               "--ssl-keyfile", str(cert[1]), "--max-model-len", "64", "--max-n", "3", cafile=str(cert[0]))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def secure_client(secure, cert):
    from openai import OpenAI
    return OpenAI(base_url=secure.url + "/v1", api_key=KEYS[1], max_retries=0,
                  http_client=httpx.Client(verify=str(cert[0])))


def assert_401(r):
    assert r.status_code == 401, r.text
    assert r.json() == {"error": {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                  "param": None, "code": "invalid_api_key"}}
    assert r.headers["www-authenticate"] == "Bearer"


def test_openai_client_over_tls_with_a_key(secure, secure_client, model_dir):
    r = secure_client.completions.create(model=secure.model, prompt="the quick brown", max_tokens=8, temperature=0)
    model, tok, _ = load(str(model_dir))
    expected = generate(model, [tok.encode("the quick brown")], Sampling(max_new_tokens=8, eos_token_id=0))[0]
    assert r.choices[0].text == tok.decode([t for t in expected if t != 0])
    assert [m.id for m in secure_client.models.list().data] == [secure.model]
    import openai
    wrong = secure_client.with_options(api_key="sk-first-kez")
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.completions.create(model=secure.model, prompt="hi", max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"


@pytest.mark.parametrize("method, path, body", [
    ("GET", "/v1/models", None), ("POST", "/v1/completions", {"model": "tiny-gpt2", "prompt": "hi"}),
    ("POST", "/v1/chat/completions", {"model": "tiny-gpt2", "messages": []}),
    ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [1]}), ("GET", "/metrics", None),
    ("GET", "/v1/no-such-path", None), ("POST", "/v1/completions", '{"model": "tiny'),  # malformed: 401 first
])
@pytest.mark.parametrize("auth", [None, "Bearer sk-wrong", "Bearer sk-first-key-and-more", "Bearer sk-first-ke",
                                  "Basic sk-first-key", "sk-first-key", "Bearer"])
def test_every_guarded_path_refuses_without_the_key(secure, cert, method, path, body, auth):
    headers = {"Content-Type": "application/json", **({"Authorization": auth} if auth is not None else {})}
    content = body if isinstance(body, str) or body is None else json.dumps(body)
    r = httpx.request(method, secure.url + path, content=content, headers=headers, verify=str(cert[0]))
    assert_401(r)
    # a wrong key and a prefix of a right one read alike: nothing tells which keys exist
    assert r.json()["error"]["message"] == ("missing API key: send the header `Authorization: Bearer KEY`"
                                            if auth is None else "invalid API key")


def test_keys_open_what_they_guard_and_health_stays_open(secure, cert):
    v = str(cert[0])
    assert httpx.get(secure.url + "/health", verify=v).status_code == 200
    assert httpx.get(secure.url + "/openapi.json", verify=v).status_code == 200
    for key in KEYS:
        auth = {"Authorization": f"Bearer {key}"}
        assert httpx.get(secure.url + "/metrics", headers=auth, verify=v).status_code == 200
        r = httpx.post(secure.url + "/tokenize", json={"prompt": "the lazy dog"}, headers=auth, verify=v)
        assert r.status_code == 200 and r.json()["max_model_len"] == 64
    auth = {"Authorization": f"bearer {KEYS[0]}"}  # the scheme is case-insensitive (RFC 7235)
    assert httpx.post(secure.url + "/detokenize", json={"tokens": [1]}, headers=auth, verify=v).status_code == 200
    over = httpx.post(secure.url + "/v1/completions", content=b"x" * (2 << 20), headers=auth, verify=v)
    assert over.status_code == 413  # with the key, the body limit is next
    assert_401(httpx.post(secure.url + "/v1/completions", content=b"x" * (2 << 20), verify=v))  # without: 401


def test_curl_over_tls(secure, cert):
    if not shutil.which("curl"):
        pytest.skip("curl is not installed")
    body = json.dumps({"model": secure.model, "prompt": "Hello", "max_tokens": 5, "temperature": 0})
    args = ["curl", "-s", secure.url + "/v1/completions", "-H", "Content-Type: application/json", "-d", body]
    out = subprocess.run([*args, "--cacert", str(cert[0]), "-H", f"Authorization: Bearer {KEYS[0]}"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["usage"]["completion_tokens"] <= 5
    out = subprocess.run([*args, "--cacert", str(cert[0])], capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["error"]["code"] == "invalid_api_key"
    # the certificate is really checked: without the CA curl refuses (60), and plain HTTP gets no answer
    assert subprocess.run(args, capture_output=True).returncode == 60
    plain = subprocess.run(["curl", "-s", secure.url.replace("https", "http") + "/health"], capture_output=True)
    assert plain.returncode != 0 or b'"ok"' not in plain.stdout


def test_max_model_len_refuses_past_it(secure, secure_client):
    import openai
    ids = list(range(1, 41))  # 40 prompt tokens
    ok = secure_client.completions.create(model=secure.model, prompt=ids, max_tokens=24,
                                          extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 24  # 40 + 24 = 64: exactly the limit
    with pytest.raises(openai.BadRequestError) as e:
        secure_client.completions.create(model=secure.model, prompt=ids, max_tokens=25)
    err = e.value.body
    assert e.value.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert err["message"] == ("prompt (40 tokens) + max_tokens (25) = 65 exceeds this server's --max-model-len of "
                              "64 tokens")
    assert secure_client.models.list().data[0].model_extra["max_model_len"] == 64


@pytest.mark.parametrize("kw, param, text", [
    ({"n": 4}, "n", "n (4) exceeds this server's limit of 3 (--max-n)"),
    ({"best_of": 4}, "best_of", "best_of (4) exceeds this server's limit of 3 (--max-n)"),
    ({"n": 3, "best_of": 2}, "best_of", "best_of (2) must be at least n (3)"),
    ({"n": 1, "best_of": 3, "stream": True}, "best_of", "best_of (3) > n (1) cannot be streamed"),
])
def test_n_and_best_of_caps(secure, secure_client, kw, param, text):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        secure_client.completions.create(model=secure.model, prompt="dog", max_tokens=4, **kw)
    assert e.value.body["param"] == param and e.value.body["message"].startswith(text)


def test_best_of_returns_the_n_likeliest_candidates(secure, secure_client):
    """best_of 3, n 2: of the three candidates (seeds s, s+1, s+2, as n=3 draws them) the two of highest
    cumulative log-prob, best first; usage counts all three."""
    common = dict(model=secure.model, prompt="dog", max_tokens=6, temperature=1.0, seed=11,
                  extra_body={"ignore_eos": True})
    three = secure_client.completions.create(n=3, logprobs=0, **common).choices
    total = {c.text: sum(c.logprobs.token_logprobs) for c in three}
    assert len(set(total.values())) == 3  # three distinct candidates, else the ranking is vacuous
    best = sorted(total, key=total.get, reverse=True)[:2]
    r = secure_client.completions.create(n=2, best_of=3, **common)
    assert [c.text for c in r.choices] == best and [c.index for c in r.choices] == [0, 1]
    assert all(c.logprobs is None for c in r.choices)  # ranked by log-probs, shown only when asked
    assert r.usage.completion_tokens == 18
    shown = secure_client.completions.create(n=2, best_of=3, logprobs=0, **common).choices
    assert [sum(c.logprobs.token_logprobs) for c in shown] == pytest.approx(sorted(total.values())[::-1][:2])
    one = secure_client.completions.create(n=1, best_of=3, **common).choices
    assert [c.text for c in one] == best[:1]


def test_sigterm_over_tls_with_an_idle_pooled_client_exits_0(secure, secure_client):
    """The last test of `secure`: the client's keep-alive connection is open and idle; the server still drains
    and exits 0 on its own (asyncio would wait 30 s for that client's TLS close_notify; Server.stop kills at 30)."""
    secure_client.models.list()
    secure.stop()
    assert secure.proc.returncode == 0


@pytest.fixture(scope="module")
def guarded(model_dir):
    """The key from the environment, /metrics public, at most 2 connections, served as gpt2 and tiny."""
    s = Server(model_dir, "--metrics-public", "--limit-concurrency", "2", "--served-model-name", "gpt2", "tiny",
               env={"GPT2FFN_API_KEY": "sk-from-env"})
    yield s
    s.stop()


def test_env_key_and_public_metrics(guarded):
    assert_401(httpx.get(guarded.url + "/v1/models"))
    assert_401(httpx.get(guarded.url + "/v1/models", headers={"Authorization": f"Bearer {KEYS[0]}"}))
    assert httpx.get(guarded.url + "/v1/models", headers={"Authorization": "Bearer sk-from-env"}).status_code == 200
    assert "gpt2ffn_requests_total" in httpx.get(guarded.url + "/metrics").text  # --metrics-public: no key


def test_served_model_names(guarded, model_dir):
    """vLLM's --served-model-name: each name is a model a request may ask for; answers carry the first, as vLLM's
    do; the directory's own name is then not one."""
    from openai import NotFoundError, OpenAI
    with OpenAI(base_url=guarded.url + "/v1", api_key="sk-from-env", max_retries=0) as client:  # --limit-concurrency
        assert guarded.model == "gpt2" and [m.id for m in client.models.list().data] == ["gpt2", "tiny"]
        for name in ("gpt2", "tiny"):
            assert client.models.retrieve(name).id == name
            r = client.completions.create(model=name, prompt="the quick", max_tokens=3, temperature=0)
            assert r.model == "gpt2" and r.usage.completion_tokens == 3
        with pytest.raises(NotFoundError, match="model 'tiny-gpt2' does not exist; this server has 'gpt2' or 'tiny'"):
            client.completions.create(model=model_dir.name, prompt="the quick", max_tokens=3)


def test_limit_concurrency_is_503_in_openai_shape(guarded):
    from openai import InternalServerError, OpenAI
    client = OpenAI(base_url=guarded.url + "/v1", api_key="sk-from-env", max_retries=0)
    assert client.models.list().data[0].id == guarded.model
    idle = socket.create_connection(("127.0.0.1", guarded.port))  # one more connection: the limit of 2 is reached
    try:
        for _ in range(50):  # until the server has accepted the idle connection
            try:
                client.models.list()
            except InternalServerError as e:
                err = e
                break
            time.sleep(0.05)
        else:
            pytest.fail("no 503 at the connection limit")
    finally:
        idle.close()
    assert err.status_code == 503 and err.response.headers["retry-after"] == "1"
    assert err.body["type"] == "server_busy" and "--limit-concurrency" in err.body["message"]
    time.sleep(0.2)
    assert client.models.list().data[0].id == guarded.model  # the idle connection gone: served again


@pytest.mark.parametrize("host, keys, warned", [("0.0.0.0", [], True), ("::", [], True), ("0.0.0.0", ["k"], False),
                                               ("127.0.0.1", [], False), ("localhost", [], False)])
def test_one_warning_for_an_open_server_without_keys(monkeypatch, capsys, cert, host, keys, warned):
    """serve() as far as uvicorn's Server.run (replaced here): one warning line exactly when it binds beyond
    loopback without a key; the certificate and key reach uvicorn, and so does the socket serve() bound."""
    import signal as signal_module

    import uvicorn

    from gpt2ffn.serving.http import serve
    ran = {}


    def run(server, sockets):
        ran.update(vars(server.config), sockets=sockets)
        for sock in sockets:
            sock.close()
    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setattr(signal_module, "signal", lambda *a: None)  # serve() sets SIGTERM's handler: not here's
    monkeypatch.setattr("asyncio.constants.SSL_SHUTDOWN_TIMEOUT", 30.0)  # serve() shortens it for its process
    serve("random:tiny", host=host, port=8123, api_keys=keys, ssl_certfile=str(cert[0]), ssl_keyfile=str(cert[1]),
          max_n=4)
    out, err = capsys.readouterr()
    expected = [f"warning: serving on {host} without an API key: anyone who can reach port 8123 can use it (give "
                "--api-key KEY or set GPT2FFN_API_KEY)"] if warned else []
    assert [line for line in err.splitlines() if "warning" in line] == expected
    assert f"on https://{host}:8123" in out
    assert ran["host"] == host and ran["limit_concurrency"] is None and ran["sockets"][0].family in (
        socket.AF_INET, socket.AF_INET6)
    assert (ran["ssl_certfile"], ran["ssl_keyfile"]) == (str(cert[0]), str(cert[1]))


def test_loopback_and_authorized():
    from gpt2ffn.serving.http import authorized, digest, loopback
    assert all(map(loopback, ["127.0.0.1", "127.0.0.2", "::1", "localhost"]))
    assert not any(map(loopback, ["0.0.0.0", "::", "10.1.2.3", "192.168.0.1"]))
    keys = [digest(k) for k in KEYS]
    assert authorized("Bearer sk-second-key", keys) and authorized("bearer  sk-first-key", keys)
    assert not any(authorized(h, keys) for h in [None, "", "Bearer", "Bearer sk-first", "Token sk-first-key",
                                                 "Bearer sk-first-key2", "sk-first-key"])
    assert not authorized("Bearer sk-first-key", [])


@pytest.mark.parametrize("argv, message", [
    (["--limit-concurrency", "1"], "--limit-concurrency must be in [2, inf], got 1"),
    (["--port", "99999"], "gpt2ffn serve: argument --port: a TCP port is an int in [0, 65535], got '99999'"),
    (["--port", "-5"], "gpt2ffn serve: argument --port: a TCP port is an int in [0, 65535], got '-5'"),
    (["--max-n", "0"], "--max-n must be in [1, 128], got 0"),
    (["--stream-interval", "0"], "--stream-interval must be in [1, inf], got 0"),
    (["--max-model-len", "0"], "--max-model-len must be in [1, inf], got 0"),
    (["--api-key", ""], "--api-key: a key must be non-empty"),
    (["--api-key", "two words"], "--api-key: a key must be non-empty"),
    (["--ssl-keyfile", "key.pem"], "--ssl-keyfile needs --ssl-certfile"),
    (["--ssl-certfile", "/nonexistent.pem"], "--ssl-certfile '/nonexistent.pem' / --ssl-keyfile None: cannot load"),
    (["--served-model-name", "gpt2", "gpt2"],
     "--served-model-name takes distinct, non-empty names, got ['gpt2', 'gpt2']"),
    (["--served-model-name", " "], "--served-model-name takes distinct, non-empty names"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0 seconds, got -1.0"),
    (["--model", "random:foo"], "unknown config name 'foo'"),  # before "listening on ..." is printed
    (["--model", "nobody/gpt9"], "model 'nobody/gpt9' is neither a checkpoint directory, a model id in the local HF"),
])
def test_serve_flags_refused_in_one_line(capsys, argv, message):
    assert main(["serve", "--model", "random:tiny", *argv]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"error: {message}") and err.count("\n") == 1 and not out


def test_max_model_len_beyond_the_context_is_refused(model_dir):
    from gpt2ffn.errors import Gpt2ffnError
    from gpt2ffn.serving.service import Service
    with pytest.raises(Gpt2ffnError, match=r"--max-model-len 129 is outside \[1, 128\], the model's context"):
        Service(str(model_dir), max_model_len=129).load()
    svc = Service(str(model_dir), max_batch=4, max_model_len=40)
    svc.load()
    # the KV cache holds max_batch sequences of --max-model-len positions, not of the model's whole context
    assert svc.engine.max_len == 40 and svc.engine.cache.num_blocks * svc.engine.cache.block_size == 4 * 40
    svc.loop.stop()


def test_serve_freezes_the_start_up_heap_and_nothing_else_does(model_dir):
    """serve()'s process moves what start-up made out of the cyclic collector's sight (gc.freeze, as vLLM after
    its warm-up), so a full collection no longer walks the model's and torch's objects; a Service made elsewhere
    (an app in a test, a library user's) leaves the collector alone."""
    import gc

    from gpt2ffn.serving.service import Service
    gc.unfreeze()
    svc = Service(str(model_dir), max_batch=2, max_model_len=40)
    svc.load()
    svc.loop.stop()
    assert gc.get_freeze_count() == 0
    svc = Service(str(model_dir), max_batch=2, max_model_len=40, freeze_heap=True)
    try:
        svc.load()
        svc.loop.stop()
        assert gc.get_freeze_count() > 10_000  # torch's modules and functions at least
    finally:
        gc.unfreeze()


@pytest.fixture(scope="module")
def ids_server(model_dir, tmp_path_factory):
    """--skip-tokenizer-init on a checkpoint with no tokenizer files (the model's alone)."""
    d = tmp_path_factory.mktemp("no_tokenizer") / "tiny-gpt2-ids"
    d.mkdir()
    for name in ("config.json", "model.safetensors"):
        (d / name).symlink_to(model_dir / name)
    s = Server(d, "--skip-tokenizer-init")
    yield s
    s.stop()


def test_a_checkpoint_without_a_tokenizer_is_served_in_token_ids(ids_server, model_dir, capsys):
    """Without the flag: one line naming it, exit 2. With it (vLLM's --skip-tokenizer-init): token ids in,
    token ids out (text empty), greedy equal to the Python API's, streamed alike; what needs text is a 400."""
    assert main(["serve", "--model", str(ids_server.proc.args[5]), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer in" in err and "--skip-tokenizer-init" in err and err.count("\n") == 1
    model, _, _ = load(str(model_dir))
    prompt = [5, 17, 42, 9]
    expected = generate(model, [prompt], Sampling(max_new_tokens=10, eos_token_id=model.config.eos_token_id))[0]
    r = post(ids_server, prompt=prompt, max_tokens=10, temperature=0, logprobs=1)
    choice = r["choices"][0]
    assert choice["token_ids"] == expected and choice["prompt_token_ids"] == prompt and choice["text"] == ""
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in expected]
    assert choice["logprobs"]["text_offset"] == [0] * len(expected)
    assert r["usage"]["completion_tokens"] == len(expected)
    chunks = stream_chunks(ids_server, prompt=prompt, max_tokens=10, temperature=0)
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == expected
    assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt and chunks[-1]["choices"][0]["finish_reason"]
    two = post(ids_server, prompt=[prompt, [7, 8]], max_tokens=3, temperature=0, echo=True)["choices"]
    assert [c["prompt_token_ids"] for c in two] == [prompt, [7, 8]] and two[0]["token_ids"] == expected[:3]
    for path, body, param in (("/v1/completions", {"prompt": "Hello"}, "prompt"),
                              ("/v1/completions", {"prompt": [1, 2], "stop": ["x"]}, "stop"),
                              ("/tokenize", {"prompt": "Hello"}, "prompt"),
                              ("/detokenize", {"tokens": [1, 2]}, "tokens")):
        bad = httpx.post(ids_server.url + path, json={"model": ids_server.model, **body})
        assert bad.status_code == 400, (path, bad.text)
        err = bad.json()["error"]
        assert err["param"] == param and err["code"] == "no_tokenizer" and "tokenizer" in err["message"], err
    assert main(["serve", "--model", "random:tiny", "--skip-tokenizer-init", "--chat-template", __file__]) == 2
    assert "not with --skip-tokenizer-init" in capsys.readouterr().err


# ---- doors an outside round found shut (real clients: the openai package, curl, httpx) --------------------------

def test_bad_input_is_a_400_in_openai_shape_never_a_500(server, client):
    """Lone surrogates (valid JSON, not Unicode), a logit_bias key of non-ASCII digits, routes and methods that do
    not exist, a body that is not JSON: each an error in OpenAI's shape naming what is wrong; the connection
    serves the next request (a plain-text 500 left it reset)."""
    m = server.model
    with httpx.Client(base_url=server.url) as h:  # one keep-alive connection for every request
        for body, param, says in [
            ({"prompt": "\ud800"}, "prompt", "holds a lone surrogate (U+D800), which is not Unicode text"),
            ({"prompt": ["ok", "\ud83d"]}, "prompt", "lone surrogate (U+D83D)"),
            ({"prompt": "hi", "logit_bias": {"\u00b2": 1}}, "logit_bias", "is not a token id"),
            ({"prompt": "hi", "suffix": "x"}, "suffix", "suffix is not supported"),
        ]:
            r = h.post("/v1/completions", content=json.dumps({"model": m, "max_tokens": 2, **body}),
                       headers={"content-type": "application/json"})  # json.dumps writes "\ud800" as JSON does
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and says in err["message"], r.text
        r = h.post("/tokenize", content=json.dumps({"prompt": "\ud800"}), headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        for method, path, status in [("get", "/nope", 404), ("get", "/v1/completions", 405)]:
            r = getattr(h, method)(path)
            assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
        r = h.post("/v1/completions", content=b'{"model": "x", "prompt": ',
                   headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] is None
        assert r.json()["error"]["message"].startswith("the request body is not valid JSON (at byte ")
        r = h.post("/v1/completions", content=b"model=x")  # curl -d without -H 'Content-Type: application/json'
        assert r.status_code == 400 and "sent with Content-Type: application/json" in r.json()["error"]["message"]
        ok = h.post("/v1/completions", json={"model": m, "prompt": "hi", "max_tokens": 2, "temperature": None,
                                             "n": None, "stream": None, "suffix": None})  # null: the default
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 1
    assert client.models.retrieve(m).id == m


@ENGINE
def test_a_non_streamed_request_stops_when_its_client_leaves(engine):
    """Its client gone (a timeout), the request is cancelled within a step or so, not run to max_tokens (~20 s
    here): a non-streamed answer sends nothing until the end, so the server asks the connection as it goes."""
    s = Server("random:gpt2", "--max-batch", "2", "--engine-process", engine)

    def cancelled():
        line = next(x for x in httpx.get(s.url + "/metrics").text.splitlines()
                    if x.startswith("gpt2ffn_cancelled_total"))
        return float(line.split()[-1])
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/completions", json={"model": s.model, "prompt": [1, 2], "max_tokens": 900,
                                                        "n": 2, "ignore_eos": True}, timeout=1.0)
        deadline = time.time() + 5
        while cancelled() < 2 and time.time() < deadline:
            time.sleep(0.1)
        assert cancelled() == 2 and httpx.get(s.url + "/health").json()["running"] == 0
    finally:
        s.stop()


def test_chat_templates_as_hf_writes_them(tmp_path, model_dir, capsys):
    """HF's templates call raise_exception (roles must alternate): defined as HF's apply_chat_template defines
    it, and what it raises is a 400 naming messages; a template that does not parse is one line, exit 2."""
    (tmp_path / "hf.jinja").write_text(
        "{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    s = Server(model_dir, "--chat-template", str(tmp_path / "hf.jinja"))
    try:
        ok = httpx.post(s.url + "/v1/chat/completions", json={"model": s.model, "max_tokens": 2,
                                                              "messages": [{"role": "user", "content": "hi"}]})
        bad = httpx.post(s.url + "/v1/chat/completions", json={"model": s.model, "max_tokens": 2, "messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]})
    finally:
        s.stop()
    assert ok.status_code == 200 and bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    assert "Conversation roles must alternate" in bad.json()["error"]["message"]
    (tmp_path / "bad.jinja").write_text("{{ unclosed")
    assert main(["serve", "--model", "random:tiny", "--chat-template", str(tmp_path / "bad.jinja")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --chat-template {tmp_path / 'bad.jinja'}: line 1: ") and err.count("\n") == 1
    (tmp_path / "empty.jinja").write_text("\n")  # it was taken, and every chat prompt rendered as ""
    assert main(["serve", "--model", "random:tiny", "--chat-template", str(tmp_path / "empty.jinja")]) == 2
    assert "empty.jinja is empty: give a Jinja template" in capsys.readouterr().err


def test_a_port_in_use_or_a_bad_host_is_one_line(capsys):
    """Bound before the model loads: one line, exit 2 (uvicorn's own bind failed while the loader ran, and the
    process died with SIGABRT)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "random:tiny", "--port", str(port)]) == 2
        assert capsys.readouterr().err == f"error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
    assert main(["serve", "--model", "random:tiny", "--host", "999.1.1.1"]) == 2
    assert capsys.readouterr().err.startswith("error: --host '999.1.1.1' does not resolve: ")
    assert main(["serve", "--model", "random:tiny", "--max-model-len", "2000"]) == 2  # before "listening on"
    out, err = capsys.readouterr()
    assert out == "" and err == "error: --max-model-len 2000 is outside [1, 128], the model's context (n_positions)\n"
    for flag, value in (("--max-batch", "0"), ("--max-waiting", "-1"), ("--threads", "0")):
        assert main(["serve", "--model", "random:tiny", flag, value]) == 2
        assert capsys.readouterr().err.startswith(f"error: {flag} must be in [")


def test_defaults_fit_the_context_and_chat_takes_content_parts(server, client):
    """max_tokens not sent: OpenAI's 16 (completions) or the room left (chat), never more than the context has
    room for; one too large names the context, not a schema bound; chat content as OpenAI's text parts or null."""
    m = server.model
    long = [1] * 120  # the tiny model's context is 128: 8 positions left
    r = post(server, prompt=long, temperature=0)
    assert 1 <= r["usage"]["completion_tokens"] <= 8  # OpenAI's 16 cut to the room left, not a 400
    r = httpx.post(server.url + "/v1/completions", json={"model": m, "prompt": [1] * 128})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert "leaves no room for a new token" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"model": m, "prompt": "hi", "max_tokens": 100000})
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "max_tokens (100000) exceeds the model's context of 128 tokens"
    parts = client.chat.completions.create(model=m, max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]},
        {"role": "assistant", "content": None}, {"role": "user", "content": "again"}])
    plain = client.chat.completions.create(model=m, max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "Hello world"}, {"role": "assistant", "content": ""},
        {"role": "user", "content": "again"}])
    assert parts.choices[0].message.content == plain.choices[0].message.content
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": m, "max_tokens": 0,
                                                              "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens must be at least 1"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": m, "max_tokens": 4, "messages": [
        {"role": "user", "content": "the quick brown fox " * 40}]})  # a chat's prompt is its messages: named so
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages", err
    assert re.fullmatch(r"messages \(\d+ tokens once templated\) \+ max_tokens \(4\) = \d+ exceeds the model's "
                        r"context of 128 tokens", err["message"]), err


def test_chat_logprobs_in_openais_shape(server, client):
    """logprobs / top_logprobs on chat: choices[].logprobs.content, one entry per token with its text, bytes
    (joined: the answer's UTF-8) and top ones; equal to the completions' log-probs of the rendered prompt, and
    a stream's chunks joined equal the whole answer's."""
    m, messages = server.model, [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=m, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob and e.logprob <= 0 for e in content)
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == r.choices[0].message.content
    done = client.completions.create(model=m, prompt="user: hi\nassistant:",  # what CHAT_TEMPLATE renders
                                     max_tokens=6, temperature=0, logprobs=2)
    assert [e.logprob for e in content] == pytest.approx(done.choices[0].logprobs.token_logprobs, abs=1e-6)
    chunks = list(client.chat.completions.create(model=m, messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [e for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(model=m, messages=messages, max_tokens=2, temperature=0,
                                           response_format={"type": "text"}, parallel_tool_calls=False)
    assert plain.choices[0].logprobs is None
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": m, "messages": messages,
                                                              "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    bad = httpx.post(server.url + "/v1/chat/completions", json={"model": m, "messages": messages, "top_logprobs": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"


@pytest.mark.cuda
@pytest.mark.parametrize("mode", [(), ("--batch-invariant",)])
def test_cuda_server_streams_and_answers_as_in_process(model_dir, mode):
    """On a GPU, `serve --device cuda` (bf16, its CUDA graphs; or batch-invariant): the openai client's greedy
    answer is the in-process engine's on the same card, streaming gives the whole answer, and in batch-invariant
    mode 8 concurrent clients, greedy and seeded, each get what they got alone."""
    from openai import OpenAI
    s = Server(model_dir, "--device", "cuda", *mode)
    try:
        client = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        r = client.completions.create(model=s.model, prompt="the quick brown", max_tokens=12, temperature=0)
        _, tok, _ = load(str(model_dir))
        model = load_model_cuda(model_dir)
        ids = tok.encode("the quick brown")
        want = generate(model, [ids], Sampling(max_new_tokens=12, eos_token_id=model.config.eos_token_id))[0]
        assert r.choices[0].text == tok.decode([t for t in want if t != model.config.eos_token_id])
        parts = [c.choices[0].text for c in client.completions.create(
            model=s.model, prompt="Hello", max_tokens=20, temperature=0, stream=True) if c.choices]
        assert "".join(parts) == client.completions.create(model=s.model, prompt="Hello", max_tokens=20,
                                                           temperature=0).choices[0].text
        if mode:
            bodies = [dict(prompt=f"the {w} fox", max_tokens=16, temperature=0) for w in ["quick", "lazy", "a", "b"]]
            bodies += [dict(prompt=f"Hello {i}", max_tokens=16, temperature=1.0, top_p=0.9, seed=i) for i in range(4)]
            solo = [post(s, **b)["choices"][0]["text"] for b in bodies]
            together = [None] * len(bodies)
            threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, post(s, **bodies[i])["choices"][0]
                                                                               ["text"])) for i in range(len(bodies))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert together == solo
    finally:
        s.stop()


def load_model_cuda(model_dir):
    """The served checkpoint as `serve --device cuda` loads it: bf16 on the GPU, weights only."""
    import torch

    from gpt2ffn.model import load_model
    return load_model(str(model_dir), dtype=torch.bfloat16, precision=None).to("cuda")


def engine_pid(s) -> int:
    """The pid of a server's engine process (serve --engine-process on)."""
    children = [int(c) for f in os.scandir(f"/proc/{s.proc.pid}/task")
                for c in open(f"{f.path}/children").read().split()
                if b"gpt2ffn.serving.core" in open(f"/proc/{c}/cmdline", "rb").read()]
    assert len(children) == 1, children
    return children[0]


def test_the_engine_process_warns_on_one_line_as_the_cli(default_ids):
    """loading's warning (bos/eos outside the vocabulary) came from the engine's own process in Python's two-line
    format (file, line, the warn() call quoted): one line, as the CLI and a one-process server print it."""
    s = Server(default_ids, "--engine-process", "on")
    s.stop()
    err = s.proc.stderr.read()
    lines = [line for line in err.splitlines() if "bos_token_id" in line or "warn(" in line or "Warning" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: the checkpoint's bos_token_id 50256"), err


@pytest.mark.parametrize("api_servers", ["1", "2"])
def test_an_engine_process_that_dies_ends_its_streams_with_an_error_and_the_server_with_1(api_servers):
    """The engine's process killed mid-stream: the stream ends with an error event naming it, and the server, which
    could only answer 503 from then on, says why on stderr and ends with exit code 1 (every API process), so that a
    supervisor starts it again (it served 503s, unsaid, until stopped). Requests that come in the meantime get a
    503 naming it (test_what_a_gone_engine_answers)."""
    s = Server("random:gpt2", "--max-batch", "2", "--engine-process", "on", "--api-servers", api_servers)
    try:
        lines = []
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                          json={"model": s.model, "prompt": "x", "max_tokens": 900, "stream": True}) as r:
            for line in r.iter_lines():
                if line and not lines:
                    os.kill(engine_pid(s), signal.SIGKILL)
                if line:
                    lines.append(line)
        error = json.loads(lines[-1].removeprefix("data: "))["error"]  # (code -9) where that process started it
        assert error["message"].startswith("generation failed: the engine process exited"), error
        children = [int(c) for f in os.scandir(f"/proc/{s.proc.pid}/task")
                    for c in open(f"{f.path}/children").read().split()]
        assert s.proc.wait(30) == 1
        err = s.proc.stderr.read()
        assert err.count("gpt2ffn: the engine process exited (code -9); the server ends (exit 1)") == 1, err
        assert "Traceback" not in err and "API process" not in err, err
        assert not any(os.path.exists(f"/proc/{c}") and open(f"/proc/{c}/stat").read().split()[2] != "Z"
                       for c in children)
    finally:
        s.stop()


def test_what_a_gone_engine_answers():
    """Once the engine's channel has ended: a new request is refused (EngineGone: the route's 503) and /metrics has
    no engine part to add (None: the route's 503, a failed scrape, where it was an empty 200); the server is told
    once (died), and a stop it asked for tells it nothing."""
    import asyncio
    from multiprocessing.connection import Connection

    from gpt2ffn.serving.core import EngineGone, EngineProcess
    from gpt2ffn.serving.engine import Request
    from gpt2ffn.serving.sampling import Sampling

    told = []

    async def run(stop: bool):
        mine, theirs = socket.socketpair()
        engine = EngineProcess(Connection(mine.detach()))
        engine.died = told.append
        engine.loop = asyncio.get_running_loop()
        engine.loop.add_reader(engine.conn.fileno(), engine.readable)
        theirs.close()
        if stop:
            engine.stop()
            assert engine.gone
            return
        await asyncio.sleep(0.05)
        assert engine.gone == "the engine process exited"
        assert await engine.exposition() is None
        with pytest.raises(EngineGone, match="the engine process exited"):
            await engine.submit(Request([1, 2], Sampling()))
    asyncio.run(run(stop=False))
    assert told == ["the engine process exited"]
    asyncio.run(run(stop=True))
    assert told == ["the engine process exited"]


def test_a_killed_server_takes_its_engine_process_with_it():
    s = Server("random:tiny", "--engine-process", "on")
    child = engine_pid(s)
    s.proc.kill()
    s.proc.wait()
    deadline = time.time() + 10
    while time.time() < deadline and os.path.exists(f"/proc/{child}") and \
            open(f"/proc/{child}/stat").read().split(")")[1].split()[0] != "Z":
        time.sleep(0.1)
    alive = os.path.exists(f"/proc/{child}") and open(f"/proc/{child}/stat").read().split(")")[1].split()[0] != "Z"
    assert not alive, "the engine process outlived its server"


@pytest.mark.parametrize("engine", ["off", "on"])
def test_weights_that_do_not_load_are_one_line_and_exit_2(model_dir, tmp_path, engine):
    """A checkpoint whose weights file is broken (config and tokenizer fine): one error line, exit 2, in either
    place the engine loads."""
    d = tmp_path / "broken"
    d.mkdir()
    for f in model_dir.iterdir():
        if f.name != "model.safetensors":
            (d / f.name).symlink_to(f)
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    out = subprocess.run([sys.executable, "-m", "gpt2ffn.cli", "serve", "--model", str(d), "--port",
                          str(free_port()), "--engine-process", engine], capture_output=True, text=True, timeout=120)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr, out.stderr


def test_engine_process_and_tp_are_refused_together():
    from gpt2ffn.errors import Gpt2ffnError
    from gpt2ffn.serving.http import serve
    with pytest.raises(Gpt2ffnError, match="--engine-process on does not combine with --tp"):
        serve("random:tiny", tp=2, engine_process="on")


def test_api_servers_share_one_engine_its_limits_and_its_metrics():
    """--api-servers 2: two processes serve the port in front of one engine process. The engine's limits hold
    across both (one running + two waiting, the rest 503), every answer equals the same request alone, the
    requests of both are counted in one /metrics, and Ctrl-C ends all three processes (130, no traceback)."""
    s = Server("random:gpt2", "--max-batch", "1", "--max-waiting", "2", "--api-servers", "2")
    try:
        children = [int(c) for f in os.scandir(f"/proc/{s.proc.pid}/task")
                    for c in open(f"{f.path}/children").read().split()]
        assert len(children) == 2, children  # the engine process and the second API process
        body = {"model": s.model, "prompt": "x", "max_tokens": 40, "temperature": 0}
        alone = post(s, **body)["choices"][0]["text"]
        codes, texts = [], []

        def one(stream):
            r = httpx.post(s.url + "/v1/completions", json={**body, "stream": stream}, timeout=120)
            codes.append(r.status_code)
            if r.status_code == 200 and not stream:
                texts.append(r.json()["choices"][0]["text"])

        threads = [threading.Thread(target=one, args=(i % 2 == 1,)) for i in range(6)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join()
        assert codes.count(503) == 3 and codes.count(200) == 3, codes
        assert texts and all(t == alone for t in texts)
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as c:  # a connection each: both serve
            for _ in range(8):
                assert c.post(s.url + "/v1/completions", json={**body, "max_tokens": 2}).status_code == 200
        text = httpx.get(s.url + "/metrics").text
        assert 'gpt2ffn_requests_total{code="200"} 12.0' in text and 'gpt2ffn_requests_total{code="503"} 3.0' in text
        s.proc.send_signal(signal.SIGINT)  # Ctrl-C: passed on to the second API process, no traceback from it
        assert s.proc.wait(60) == 130
        err = s.proc.stderr.read()
        assert "exited" not in err and "Traceback" not in err, err  # it ended as asked: nothing to report
        deadline = time.time() + 10
        while time.time() < deadline and any(os.path.exists(f"/proc/{c}") for c in children):
            time.sleep(0.1)
        assert not any(os.path.exists(f"/proc/{c}") for c in children)
    finally:
        s.stop()


def test_api_servers_need_the_engine_in_its_own_process(capsys):
    assert main(["serve", "--model", "random:tiny", "--api-servers", "2", "--engine-process", "off"]) == 2
    assert "--api-servers 2 puts the engine in a process of its own: not with --engine-process off" in \
        capsys.readouterr().err
    assert main(["serve", "--model", "random:tiny", "--api-servers", "0"]) == 2
    assert capsys.readouterr().err == "error: --api-servers must be at least 1, got 0\n"
    # With --tp the conflict is said first, not after "start it with torchrun" (and then this, under torchrun)
    assert main(["serve", "--model", "random:tiny", "--api-servers", "2", "--tp", "2"]) == 2
    assert capsys.readouterr().err == ("error: --api-servers 2 puts the engine in a process of its own: not with "
                                       "--tp\n")


def test_an_add_waiting_for_its_answer_when_the_engine_goes_is_refused_not_left_hanging():
    """The engine's channel ends while a request waits for the engine to admit it: submit raises EngineGone (the
    route's 503) at once; it waited forever before."""
    import asyncio
    from multiprocessing.connection import Connection

    from gpt2ffn.serving.core import EngineGone, EngineProcess
    from gpt2ffn.serving.engine import Request
    from gpt2ffn.serving.sampling import Sampling

    async def run():
        mine, theirs = socket.socketpair()
        engine = EngineProcess(Connection(mine.detach()))
        engine.loop = asyncio.get_running_loop()
        engine.loop.add_reader(engine.conn.fileno(), engine.readable)
        waiting = asyncio.create_task(engine.submit(Request([1, 2], Sampling())))
        await asyncio.sleep(0.05)
        theirs.close()
        with pytest.raises(EngineGone, match="the engine process exited"):
            await asyncio.wait_for(waiting, 3)
    asyncio.run(run())


def test_requests_refused_while_the_model_loads_are_counted_once_attached_not_sent_before():
    """With the engine in its own process, a refusal (401, 413) before the API process is attached is held in that
    process (the engine reads no channel while it loads: a flood of them filled the socket and blocked the event
    loop), then sent at attach as one count per status."""
    import asyncio
    from multiprocessing.connection import Connection

    from gpt2ffn.serving.core import EngineProcess

    async def run():
        mine, theirs = socket.socketpair()
        engine, other = EngineProcess(Connection(mine.detach())), Connection(theirs.detach())
        for code in ("413", "413", "401"):
            engine.count(code)
        assert not other.poll(0.05)  # nothing on the channel while it loads
        done = asyncio.Event()
        engine.attach(asyncio.get_running_loop(), done.set)
        await asyncio.sleep(0.05)
        got = [other.recv() for _ in range(3)]
        assert got == [("attached",), ("count", "413", 2), ("count", "401", 1)], got
        engine.count("413")  # attached: sent at once
        assert other.recv() == ("count", "413", 1)
    asyncio.run(run())
    # stopped before attach, with the engine another API process started (--api-servers): the counts go first
    mine, theirs = socket.socketpair()
    engine, other = EngineProcess(Connection(mine.detach())), Connection(theirs.detach())
    engine.count("401")
    engine.stop()
    assert [other.recv(), other.recv()] == [("count", "401", 1), ("stop",)]


@pytest.mark.parametrize("engine, sig, want, ignored", [("on", signal.SIGTERM, 0, False),
                                                        ("off", signal.SIGTERM, 0, False),
                                                        ("off", signal.SIGINT, 130, False),
                                                        ("2", signal.SIGINT, 130, False),
                                                        ("off", signal.SIGINT, 130, True)])
def test_a_signal_while_the_model_loads_ends_the_server_at_once(engine, sig, want, ignored):
    """SIGTERM (Ctrl-C) before the model is in: nothing runs to drain, exit 0 (130) at once, no traceback. With the
    engine process it is ended (the loader thread and the shutdown read the one channel at once before: torn
    messages, exit 2); with the engine thread the loader was inside native code at the interpreter's teardown:
    "terminate called without an active exception", exit 134. ignored: started with SIGINT ignored, as a shell
    script's `gpt2ffn serve ... &` starts it; uvicorn took the signal, put the ignore back and returned, and the
    server left normally under the loader: exit 134 again."""
    port = free_port()
    flags = ["--api-servers", engine] if engine.isdigit() else ["--engine-process", engine]
    proc = subprocess.Popen([sys.executable, "-m", "gpt2ffn.cli", "serve", "--model", "random:gpt2-large", "--port",
                             str(port), *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else None)
    deadline = time.time() + 60
    while time.time() < deadline:  # listening (the port answers 503 while it loads)
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 503:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    time.sleep(1)
    if engine != "off":  # /metrics while it loads: a 503 saying so at once (the engine process reads no channel
        t0 = time.time()  # yet: it was a 503 "did not answer for its metrics" after 5 s)
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert r.status_code == 503 and time.time() - t0 < 2 and "loading" in r.json()["error"]["message"], r.text
    proc.send_signal(sig)
    t0 = time.time()
    code = proc.wait(30)
    err = proc.stderr.read()
    assert code == want and time.time() - t0 < 10, (code, err)
    assert "Traceback" not in err and "error" not in err and "terminate called" not in err, err


def test_an_api_process_that_dies_is_reported_and_the_others_serve_on():
    s = Server("random:tiny", "--api-servers", "2")
    try:
        worker = next(int(c) for f in os.scandir(f"/proc/{s.proc.pid}/task")
                      for c in open(f"{f.path}/children").read().split()
                      if b"gpt2ffn.serving.http" in open(f"/proc/{c}/cmdline", "rb").read())
        os.kill(worker, signal.SIGKILL)
        time.sleep(1)
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as c:
            for _ in range(4):
                r = c.post(s.url + "/v1/completions", json={"model": s.model, "prompt": [1, 2], "max_tokens": 2})
                assert r.status_code == 200, r.text
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 0
        assert f"gpt2ffn: API process {worker} exited (code -9); the others serve on" in s.proc.stderr.read()
    finally:
        s.stop()
