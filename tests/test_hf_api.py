"""GPT2 called the way HF users call GPT2LMHeadModel: input_ids=, labels=, position_ids=, **tokenizer output,
.logits / .loss, save_pretrained. Each against HF's own model on the same weights, with a control that fails."""

import pytest
import torch
from safetensors import safe_open
from transformers import GPT2LMHeadModel

from conftest import hf_config, randomize_
from gpt2ffn import Config, Gpt2ffnError, InputError, ShapeError, tolerance
from gpt2ffn.model import GPT2, LMOutput

CFG = Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=300, bos_token_id=0, eos_token_id=299)
TOL = tolerance(torch.float32)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """An HF checkpoint written by HF's own save_pretrained (`transformer.h.0...` keys)."""
    d = tmp_path_factory.mktemp("hf")
    randomize_(GPT2LMHeadModel(hf_config(CFG)), 4).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def hf(hf_dir):
    return GPT2LMHeadModel.from_pretrained(hf_dir).eval()


def ids_of(batch, n, seed=0):
    return torch.randint(0, CFG.vocab_size, (batch, n), generator=torch.Generator().manual_seed(seed))


def close(a, b):
    return torch.allclose(a, b, atol=TOL.atol, rtol=TOL.rtol)


def test_hf_call_gives_hf_loss_and_logits(hf, hf_dir):
    ours = GPT2.from_pretrained(hf_dir)
    ids = ids_of(2, 11)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt left out of the loss, as fine-tuning scripts do
    with torch.no_grad():
        want = hf(input_ids=ids, labels=labels)
        got = ours(input_ids=ids, labels=labels)
        unshifted = torch.nn.functional.cross_entropy(got.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert isinstance(got, LMOutput)
    torch.testing.assert_close(got.logits, want.logits, atol=TOL.atol, rtol=TOL.rtol)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(unshifted, want.loss, atol=1e-3)  # control: the loss without HF's shift differs
    # HF's indexing: out[0] is the loss when there is one, the logits otherwise; out["logits"]; to_tuple()
    assert got[0] is got.loss and got[1] is got.logits and got["logits"] is got.logits
    with torch.no_grad():
        plain = ours(input_ids=ids)
        assert plain.loss is None and plain[0] is plain.logits
        with pytest.raises(KeyError):  # as HF's: a field that is not set is not there
            plain["loss"]
        assert ours(input_ids=ids, labels=labels, return_dict=False)[0] == got.loss
        assert ours(ids, labels=labels.int()).loss == got.loss  # int32 labels, as int64
        assert torch.equal(ours(ids, return_dict=False)[0], want.logits * 0 + got.logits)  # HF's tuple, not row 0
        assert isinstance(ours(ids, use_cache=False), LMOutput)  # any of HF's arguments: HF's answer
        assert isinstance(ours(ids), torch.Tensor)  # gpt2ffn's own call keeps answering the tensor


def test_tokenizer_output_unpacked_into_the_call(hf, hf_dir):
    """model(**tokenizer(texts, padding=True, return_tensors="pt")): input_ids and a right-padded attention_mask.
    The padding positions' logits are HF's too (a padding query sees the real tokens before it, at its own
    index), so labels=input_ids with the pads in them (pad = eos, as tutorials set it) gives HF's loss."""
    ours = GPT2.from_pretrained(hf_dir)
    batch = {"input_ids": ids_of(2, 9, seed=1), "attention_mask": torch.ones(2, 9, dtype=torch.long)}
    batch["attention_mask"][1, 6:] = 0
    batch["input_ids"][1, 6:] = CFG.eos_token_id
    with torch.no_grad():
        got, want = ours(**batch, labels=batch["input_ids"]), hf(**batch, labels=batch["input_ids"])
        # the control: a padding query that sees itself (as gpt2ffn's did) gives other logits there
        itself = ours(batch["input_ids"][1:, 6:7], cache=None, position_ids=torch.tensor([[6]]))
    torch.testing.assert_close(got.logits, want.logits, atol=TOL.atol, rtol=TOL.rtol)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    assert not close(itself[0, 0], want.logits[1, 6])


def test_position_ids_as_hf(hf, hf_dir):
    ours = GPT2.from_pretrained(hf_dir)
    ids = ids_of(2, 7, seed=2)
    pos = torch.arange(7)[None] + 5
    with torch.no_grad():
        want = hf(ids, position_ids=pos).logits
        assert close(ours(ids, position_ids=pos), want)
        assert close(ours(ids, position_ids=pos[0]), want)  # (T,) broadcast, as HF's
        assert not close(ours(ids), want)  # control: positions 0..6 give other logits


def test_fine_tuning_through_labels_matches_hf(hf_dir):
    """The HF fine-tuning loop (loss = model(input_ids=, labels=).loss; backward; AdamW) on a model loaded
    with from_pretrained (weights held once, eval(): no dropout) follows HF's own step for step."""
    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    ours = GPT2.from_pretrained(hf_dir)
    ids = ids_of(2, 10, seed=3)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (hf, ours)]
    for _ in range(3):
        losses = []
        for m, opt in zip((hf, ours), opts):
            opt.zero_grad()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], abs=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)
        assert not close(ours(ids), GPT2LMHeadModel.from_pretrained(hf_dir)(ids).logits)  # control: it did train


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_save_pretrained_is_read_by_hf_and_by_us(hf_dir, tmp_path, precision):
    ours = GPT2.from_pretrained(hf_dir, precision=precision)
    ids = ids_of(1, 8, seed=4)
    out = ours.save_pretrained(tmp_path / "saved")
    with safe_open(out / "model.safetensors", "pt") as f, safe_open(hf_dir / "model.safetensors", "pt") as g:
        assert set(f.keys()) == set(g.keys())  # HF save_pretrained's keys: transformer.*, no tied lm_head
    back = GPT2.from_pretrained(out, precision=precision)
    again = GPT2LMHeadModel.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(back(ids), ours(ids))
        # the values the model computes with: fp32's exactly HF's; int8's rounded (HF on them, fp32 activations)
        want = GPT2LMHeadModel.from_pretrained(hf_dir).eval()(ids).logits
        if precision == "fp32":
            assert torch.equal(again(ids).logits, want)
        else:
            assert not close(again(ids).logits, want)
            assert all(torch.equal(v, ours.state_dict()[k]) for k, v in again.state_dict().items() if k in
                       ours.state_dict())


def test_hf_call_errors_are_one_line(hf_dir, tmp_path):
    ours = GPT2.from_pretrained(hf_dir)
    ids = ids_of(1, 6)
    cases = [
        (dict(input_ids=ids), InputError, "once"),                              # with ids as well
        (dict(output_attentions=True), InputError, "output_attentions"),
        (dict(token_type_ids=ids), InputError, "token_type_ids"),
        (dict(labels_=ids), InputError, "unexpected argument 'labels_'"),
        (dict(labels=ids[:, :3]), ShapeError, "labels has shape (1, 3)"),
        (dict(labels=ids + CFG.vocab_size), InputError, "-100"),
        (dict(labels=ids, last_only=True), InputError, "last_only"),
        (dict(position_ids=torch.arange(6)[None] + 60), InputError, "position_ids must be in [0, 64)"),
        (dict(position_ids=torch.arange(5)), ShapeError, "position_ids has shape (5,)"),
    ]
    for kwargs, error, words in cases:
        with pytest.raises(error, match=None) as e:
            ours(ids, **kwargs)
        assert words in str(e.value), (kwargs, str(e.value))
    with pytest.raises(InputError, match="needs token ids"):
        ours()
    with torch.no_grad():  # what HF's callers pass and changes nothing is taken
        assert torch.equal(ours(ids, use_cache=False, output_attentions=False, token_type_ids=None).logits, ours(ids))
    (tmp_path / "f").write_text("")
    with pytest.raises(Gpt2ffnError, match="is a file"):
        ours.save_pretrained(tmp_path / "f")


def test_save_pretrained_of_an_untied_config_keeps_its_head(tmp_path):
    """A config with tie_word_embeddings=false whose lm_head equals wte loads; saved again, its lm_head.weight is
    written, so HF (which would start a missing head random) and gpt2ffn both read it back."""
    hf = randomize_(GPT2LMHeadModel(hf_config(CFG, tie_word_embeddings=False)), 5)
    with torch.no_grad():
        hf.lm_head.weight.copy_(hf.transformer.wte.weight)
    hf.save_pretrained(tmp_path / "untied")
    ours = GPT2.from_pretrained(tmp_path / "untied")
    out = ours.save_pretrained(tmp_path / "again")
    ids = ids_of(1, 6, seed=5)
    with torch.no_grad():
        assert torch.equal(GPT2.from_pretrained(out)(ids), ours(ids))
        assert close(GPT2LMHeadModel.from_pretrained(out).eval()(ids).logits, ours(ids))


class Recorder:
    """An HF streamer (put / end) that keeps what it was given."""

    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(value.tolist())

    def end(self):
        self.calls.append("end")


def test_generate_takes_hf_arguments(hf, hf_dir):
    """HF's generate arguments give HF's ids (greedy, fp32): max_length, min_new_tokens, a GenerationConfig,
    num_beams=1 and use_cache; a streamer gets HF's calls; padding inferred from a pad_token_id as HF infers it."""
    from transformers import GenerationConfig
    ours = GPT2.from_pretrained(hf_dir)
    ids = ids_of(1, 5, seed=6)
    eos = int(hf.generate(ids, max_new_tokens=1, pad_token_id=0)[0, -1])  # the first token greedy picks, as EOS
    for kw in [dict(max_length=12), dict(max_new_tokens=6, min_new_tokens=3, eos_token_id=eos),
               dict(max_new_tokens=6, min_length=8, eos_token_id=eos),
               dict(max_new_tokens=4, num_beams=1, use_cache=True),
               dict(generation_config=GenerationConfig(max_new_tokens=5, repetition_penalty=1.3)),
               dict(generation_config=GenerationConfig(max_new_tokens=9), max_new_tokens=3)]:  # an argument wins
        want = hf.generate(ids, **kw, pad_token_id=0)
        assert torch.equal(ours.generate(ids, **kw, pad_token_id=0), want), kw
    assert ours.generate(ids, max_new_tokens=6, eos_token_id=eos, pad_token_id=0).shape[1] == 6  # the control
    got, want = Recorder(), Recorder()
    ours.generate(ids, max_new_tokens=4, streamer=got)
    hf.generate(ids, max_new_tokens=4, streamer=want, pad_token_id=0)
    assert got.calls == want.calls and got.calls[-1] == "end" and len(got.calls) == 6
    # left padding without an attention_mask: a pad id that is no EOS marks it (HF's rule)
    batch = torch.cat([ids, torch.tensor([[7, 7, 7, 7, 120]])])
    want = hf.generate(batch, max_new_tokens=5, pad_token_id=7)
    assert torch.equal(ours.generate(batch, max_new_tokens=5, pad_token_id=7), want)
    assert not torch.equal(ours.generate(batch, max_new_tokens=5, pad_token_id=7,
                                         attention_mask=torch.ones_like(batch)), want)  # the control


def test_generate_refuses_what_it_does_not_do_in_one_line(hf_dir):
    from transformers import GenerationConfig
    ours = GPT2.from_pretrained(hf_dir)
    ids = ids_of(1, 5, seed=6)
    for kw, words in [(dict(num_beams=3), "num_beams=3: beam search is not implemented"),
                      (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size=2"),
                      (dict(return_dict_in_generate=True), "return_dict_in_generate=True"),
                      (dict(generation_config=GenerationConfig(num_beams=2)), "num_beams=2"),
                      (dict(max_length=3), "max_length=3 leaves no room after the prompt's 5 tokens"),
                      (dict(streamer=Recorder(), num_return_sequences=2, do_sample=True), "a streamer takes one"),
                      (dict(foo=1), "unexpected argument 'foo'")]:
        with pytest.raises(Gpt2ffnError) as e:
            ours.generate(ids, **kw)
        assert words in str(e.value) and "\n" not in str(e.value), (kw, str(e.value))
    with pytest.raises(InputError, match=r"row 0 is \[1, 0, 1\] \(inferred from pad_token_id=7"):
        ours.generate(torch.tensor([[3, 7, 4]]), pad_token_id=7)


def test_what_hf_scripts_read_off_the_model(hf, hf_dir, tmp_path):
    ours = GPT2.from_pretrained(hf_dir)
    assert ours.device == hf.device and ours.dtype == hf.dtype
    for kw in ({}, {"exclude_embeddings": True}, {"only_trainable": True}):
        assert ours.num_parameters(**kw) == hf.num_parameters(**kw), kw
    assert ours.get_input_embeddings().weight is ours.transformer.wte.weight
    assert ours.get_output_embeddings().weight is ours.transformer.wte.weight
    c = ours.config
    assert (c.hidden_size, c.max_position_embeddings, c.num_attention_heads, c.num_hidden_layers, c.pad_token_id) \
        == (hf.config.hidden_size, hf.config.max_position_embeddings, hf.config.num_attention_heads,
            hf.config.num_hidden_layers, hf.config.pad_token_id)
    assert set(c.to_dict()) <= set(hf.config.to_dict())
    out = ours(input_ids=ids_of(1, 4), labels=ids_of(1, 4))
    assert list(out.keys()) == ["loss", "logits"] and "loss" in out and list(out) == ["loss", "logits"]
    with pytest.raises(AttributeError, match="returns no past_key_values: keep a cache of your own"):
        getattr(out, "past_key_values")  # noqa: B009
    for dtype, want in [("auto", torch.float32), ("bfloat16", torch.bfloat16), (torch.float16, torch.float16)]:
        assert GPT2.from_pretrained(hf_dir, dtype=dtype, precision=None).dtype == want
    half = GPT2.from_pretrained(hf_dir, dtype=torch.bfloat16, precision=None).save_pretrained(tmp_path / "bf16")
    assert GPT2.from_pretrained(half, dtype="auto", precision=None).dtype == torch.bfloat16  # config.json's dtype
    assert GPT2.from_pretrained(hf_dir, torch_dtype=torch.bfloat16, precision=None).dtype == torch.bfloat16
    with pytest.raises(Gpt2ffnError, match=r"dtype='int8' is not a float dtype \(int8 weights: precision='int8'\)"):
        GPT2.from_pretrained(hf_dir, dtype="int8")
    with pytest.raises(Gpt2ffnError, match=r"dtype=torch.int8 is not a float dtype \(int8 weights: precision='int8'"):
        GPT2.from_pretrained(hf_dir, dtype=torch.int8)  # was torch's TypeError from nn.Module.to


def test_a_model_id_is_read_from_the_local_hf_cache(hf_dir, tmp_path, monkeypatch):
    """'openai-community/gpt2' or 'gpt2' found in the HF cache (refs/main's snapshot), as HF's offline
    from_pretrained finds it; never downloaded; a missing id names the cache."""
    import shutil

    from gpt2ffn.loading import load
    repo = tmp_path / "hub" / "models--openai-community--gpt2"
    shutil.copytree(hf_dir, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    ids = ids_of(1, 4)
    with torch.no_grad():
        for name in ("openai-community/gpt2", "gpt2"):
            assert torch.equal(GPT2.from_pretrained(name)(ids), GPT2.from_pretrained(hf_dir)(ids))
        assert load("openai-community/gpt2", need_tokenizer=False)[2] == "openai-community/gpt2"  # not abc123
    with pytest.raises(Gpt2ffnError, match=r"nor is 'nobody/gpt9' in the local HF cache \(.*hub\); gpt2ffn never"):
        GPT2.from_pretrained("nobody/gpt9")
    assert GPT2.from_pretrained("gpt2", dtype="auto", precision=None).dtype == torch.float32  # read from the cache


def test_save_pretrained_over_a_sharded_checkpoint_removes_its_shards(small_model, tmp_path):
    """save_pretrained into a directory holding a sharded checkpoint left its shards and index beside the new
    model.safetensors, another copy of older weights; they go, as HF's save_pretrained removes them; other files
    stay."""
    small_model.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "notes.txt").write_text("mine")
    model = GPT2.from_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["config.json", "generation_config.json", "model.safetensors", "notes.txt"] or \
        left == ["config.json", "model.safetensors", "notes.txt"], left
    torch.testing.assert_close(GPT2.from_pretrained(tmp_path)(torch.tensor([[1, 2, 3]])),
                               model(torch.tensor([[1, 2, 3]])))
