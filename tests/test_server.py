"""The HTTP server as a user meets it: a subprocess on loopback, driven by the openai package, curl and raw HTTP."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from gpt2ffn.generate import Sampling, generate, load


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, *extra):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "gpt2ffn.cli", "serve", "--model", str(model),
                                      "--port", str(self.port), *extra],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stderr.read()}")
            try:
                r = httpx.get(self.url + "/health", timeout=1)
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
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog. Hello world!"] * 40, vocab_size=320)
    tok.save(str(d / "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir)
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
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "/v1/completions" in spec["paths"]


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
    ({"model": "tiny-gpt2", "prompt": "hi", "best_of": 3}, 400, "best_of", "Extra inputs"),
    ({"model": "tiny-gpt2", "prompt": "hi", "max_tokens": 1000}, 400, "max_tokens", "exceeds the model's context of 128"),
    ({"model": "tiny-gpt2", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "up to 4"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model", "does not exist"),
    ({"prompt": "hi"}, 400, "model", "Field required"),
])
def test_bad_input_gets_openai_errors(server, body, status, param, text):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + "/v1/completions", content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and text in err["message"]
    assert param is None or (err["param"] or "").startswith(param)
    assert httpx.get(server.url + "/health").status_code == 200


def test_oversized_body_is_413(server):
    r = httpx.post(server.url + "/v1/completions", content=b"x" * (2 << 20), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


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
    r = subprocess.run([st, "run", server.url + "/openapi.json", "--checks", "not_a_server_error",
                        "--max-examples", "40", "--no-color"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


@pytest.fixture(scope="module")
def slow_server():
    """gpt2-sized random weights, one running sequence and two waiting: the third concurrent request waits,
    the fourth is refused."""
    s = Server("random:gpt2", "--max-batch", "1", "--max-waiting", "2")
    yield s
    s.stop()


def test_full_queue_is_503_with_retry_after(slow_server):
    codes, headers = [], []

    def one():
        r = httpx.post(slow_server.url + "/v1/completions",
                       json={"model": slow_server.model, "prompt": "x", "max_tokens": 40}, timeout=120)
        codes.append(r.status_code)
        headers.append(r.headers.get("retry-after"))

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert 503 in codes and 200 in codes and set(codes) <= {200, 503}
    assert all(h == "1" for c, h in zip(codes, headers) if c == 503)


def test_disconnect_stops_generation(slow_server):
    before = httpx.get(slow_server.url + "/metrics").text
    def cancelled(text):
        return float(next(line for line in text.splitlines() if line.startswith("gpt2ffn_cancelled_total ")).split()[1])

    with httpx.stream("POST", slow_server.url + "/v1/completions", timeout=60,
                      json={"model": slow_server.model, "prompt": "x", "max_tokens": 900, "stream": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    deadline = time.time() + 10
    while time.time() < deadline:
        text = httpx.get(slow_server.url + "/metrics").text
        if cancelled(text) > cancelled(before) and "gpt2ffn_num_requests_running 0.0" in text:
            return
        time.sleep(0.1)
    pytest.fail("generation went on after the client disconnected")


def test_sigterm_drains_in_flight(model_dir):
    s = Server("random:gpt2")
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
