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
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog. Hello world!"] * 40, vocab_size=320,
                            special_tokens=["<|endoftext|>"])  # id 0, the tiny config's EOS
    tok.save(str(d / "tokenizer.json"))
    from transformers import PreTrainedTokenizerFast  # tokenizer_config.json too, for AutoTokenizer (lm-eval)
    PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>").save_pretrained(d)
    return d


CHAT_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def server(model_dir):
    (model_dir.parent / "chat.jinja").write_text(CHAT_TEMPLATE)
    s = Server(model_dir, "--chat-template", str(model_dir.parent / "chat.jinja"))
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
    ({"model": "tiny-gpt2", "prompt": "hi", "logprobs": -1}, 400, "logprobs", "greater than or equal to 0"),
    ({"model": "tiny-gpt2", "prompt": "hi", "echo": "maybe"}, 400, "echo", "boolean"),
    ({"model": "tiny-gpt2", "prompt": "hi", "n": 0}, 400, "n", "greater than or equal to 1"),
    ({"model": "tiny-gpt2", "prompt": ["a"] * 20, "n": 8}, 400, "n", "exceed 128 choices"),
    ({"model": "tiny-gpt2", "prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty", "less than or equal to 2"),
    ({"model": "tiny-gpt2", "prompt": "hi", "frequency_penalty": -2.5}, 400, "frequency_penalty", "greater than"),
    ({"model": "tiny-gpt2", "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty", "greater than 0"),
    ({"model": "tiny-gpt2", "prompt": "hi", "top_k": -2}, 400, "top_k", "greater than or equal to -1"),
    ({"model": "tiny-gpt2", "prompt": "hi", "min_tokens": 20, "max_tokens": 5}, 400, "min_tokens", "exceeds max_tokens"),
    ({"model": "tiny-gpt2", "prompt": "hi", "ignore_eos": "x"}, 400, "ignore_eos", "boolean"),
    ({"model": "tiny-gpt2", "prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias", "not a token id"),
    ({"model": "tiny-gpt2", "prompt": "hi", "logit_bias": {"5000": 1}}, 400, "logit_bias", "not a token id"),
    ({"model": "tiny-gpt2", "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias", "outside [-100, 100]"),
    ({"model": "tiny-gpt2", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "needs echo"),
    ({"model": "tiny-gpt2", "prompt": [1, 2, 9999]}, 400, "prompt", "outside this model's vocabulary"),
    ({"model": "tiny-gpt2", "prompt": [[1, 2], []]}, 400, "prompt", "must not be empty"),
    ({"model": "tiny-gpt2", "prompt": []}, 400, "prompt", "must not be an empty list"),
    ({"model": "tiny-gpt2", "prompt": [1.5]}, 400, "prompt", ""),
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
    s = Server("random:gpt2", "--max-batch", "4")
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
    assert r["usage"]["prompt_tokens"] == 2 * len(tok.encode("dog"))


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


def test_streaming_logprobs_and_echo(server):
    chunks = [json.loads(line[6:]) for line in httpx.post(
        server.url + "/v1/completions", timeout=60, json={"model": server.model, "prompt": "Hello", "max_tokens": 6,
                                                          "temperature": 0, "stream": True, "logprobs": 1,
                                                          "echo": True, "ignore_eos": True}).text.splitlines()
              if line.startswith("data: {")]
    whole = post(server, prompt="Hello", max_tokens=6, temperature=0, echo=True, ignore_eos=True)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"][0]["logprobs"]) == 6


def test_tokenize_detokenize(server, model_dir):
    _, tok, _ = load(str(model_dir))
    r = httpx.post(server.url + "/tokenize", json={"model": server.model, "prompt": "the lazy dog"}).json()
    assert r["tokens"] == tok.encode("the lazy dog") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 128
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "the lazy dog"
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [99999]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


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


def test_lm_eval_local_completions_equals_hf(server, model_dir, tmp_path, monkeypatch):
    """lm-evaluation-harness through the server gives HF's own loglikelihoods (1e-3) and greedy generations."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = lm_eval_tasks(tmp_path)
    manager = TaskManager(include_path=str(tmp_path))

    def run(model, args):
        out = lm_eval.simple_evaluate(model=model, model_args=args, tasks=tasks, task_manager=manager,
                                      log_samples=True, batch_size=1)
        return {t: [s["resps"] for s in sorted(out["samples"][t], key=lambda s: s["doc_id"])] for t in tasks}

    ours = run("local-completions", f"model={server.model},base_url={server.url}/v1/completions,"
                                    f"tokenizer_backend=huggingface,tokenizer={model_dir},max_length=128")
    hf = run("hf", f"pretrained={model_dir},dtype=float32,device=cpu")
    lls = [(float(a[0][0]), float(b[0][0])) for x, y in zip(ours["gpt2ffn_mc"], hf["gpt2ffn_mc"]) for a, b in zip(x, y)]
    assert len(lls) == 7 and all(abs(a - b) < 1e-3 for a, b in lls), lls
    assert ours["gpt2ffn_gen"] == hf["gpt2ffn_gen"]


def test_serve_precision_answers_as_the_model_in_process(model_dir):
    """`serve --precision int8` serves the int8 model: the prompt's log-probs equal load(..., precision="int8")'s
    and differ from fp32's (so the flag cannot be silently ignored)."""
    import torch
    tok = load(str(model_dir))[1]
    ids = tok.encode("the quick brown fox jumps")

    def logprobs(precision):
        with torch.no_grad():
            lp = torch.log_softmax(load(str(model_dir), precision=precision)[0](torch.tensor([ids]))[0].double(), -1)
        return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    s = Server(model_dir, "--precision", "int8")
    try:
        r = httpx.post(s.url + "/v1/completions", json={"model": s.model, "prompt": ids, "max_tokens": 0,
                                                         "echo": True, "logprobs": 0}, timeout=60).json()
    finally:
        s.stop()
    got = r["choices"][0]["logprobs"]["token_logprobs"][1:]
    assert got == pytest.approx(logprobs("int8"), abs=1e-4)
    assert got != pytest.approx(logprobs("fp32"), abs=1e-4)
