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
