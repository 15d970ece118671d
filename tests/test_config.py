import json

import pytest

from gpt2ffn import Config, ConfigError
from gpt2ffn.cli import GPT_CONFIG_124M


def test_presets_match_gpt2_sizes():
    sizes = {"gpt2": (768, 12, 12), "gpt2-medium": (1024, 24, 16), "gpt2-large": (1280, 36, 20),
             "gpt2-xl": (1600, 48, 25)}
    for name, (d, n_layer, n_head) in sizes.items():
        cfg = Config.from_name(name)
        assert (cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.hidden) == (d, n_layer, n_head, 4 * d)
        assert cfg.activation_function == "gelu_new" and cfg.gelu_approximate == "tanh"
    assert Config.from_name("openai-community/gpt2-xl") == Config.from_name("gpt2-xl")


def test_unknown_preset_lists_known():
    with pytest.raises(ConfigError, match="unknown config name 'gpt3'; known: gpt2, gpt2-medium"):
        Config.from_name("gpt3")


def test_book_dict_converts_at_the_edge():
    cfg = Config.from_dict(GPT_CONFIG_124M)
    assert (cfg.n_embd, cfg.n_head, cfg.n_layer, cfg.n_positions, cfg.vocab_size) == (768, 12, 12, 1024, 50257)
    assert cfg.resid_pdrop == cfg.attn_pdrop == cfg.embd_pdrop == 0.1
    assert cfg.qkv_bias is False and cfg.hidden == 3072


def test_hf_keys_and_aliases():
    cfg = Config.from_dict({"hidden_size": 200, "n_inner": 600, "num_attention_heads": 8,
                            "activation_function": "gelu"})
    assert (cfg.n_embd, cfg.hidden, cfg.n_head, cfg.gelu_approximate) == (200, 600, 8, "none")


def test_activation_map():
    for name, form in [("gelu_new", "tanh"), ("gelu_pytorch_tanh", "tanh"), ("gelu_fast", "tanh"),
                       ("gelu", "none"), ("relu", "relu")]:
        assert Config(activation_function=name).gelu_approximate == form


@pytest.mark.parametrize("kwargs, message", [
    ({"n_embd": 0}, "n_embd must be a positive int, got 0"),
    ({"n_inner": -4}, "n_inner must be a positive int or None, got -4"),
    ({"activation_function": "swish"}, "activation_function 'swish' is not supported; known: gelu_new"),
    ({"resid_pdrop": 1.5}, r"resid_pdrop must be in \[0, 1\), got 1.5"),
])
def test_bad_values(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Config(**kwargs)


def test_unknown_and_conflicting_keys():
    with pytest.raises(ConfigError, match=r"unknown config keys \['n_embed'\]"):
        Config.from_dict({"n_embed": 768})
    with pytest.raises(ConfigError, match="sets n_embd twice: 768 and 1024"):
        Config.from_dict({"n_embd": 768, "emb_dim": 1024})


def test_from_pretrained_reads_hf_config_json(tmp_path):
    from transformers import GPT2Config
    GPT2Config(n_embd=256, n_layer=3, n_head=4, n_inner=512, activation_function="gelu_fast").save_pretrained(tmp_path)
    cfg = Config.from_pretrained(tmp_path)
    assert (cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.hidden, cfg.activation_function) == (256, 3, 4, 512, "gelu_fast")
    assert Config.from_pretrained(tmp_path / "config.json") == cfg


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(ConfigError, match="no config.json at"):
        Config.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        Config.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="model_type='llama'; gpt2ffn reads GPT-2"):
        Config.from_pretrained(tmp_path)


def test_to_hf_dict_round_trips_through_hf():
    from transformers import GPT2Config
    cfg = Config.from_name("gpt2-medium", n_inner=3000, activation_function="gelu")
    assert Config.from_dict(GPT2Config(**cfg.to_hf_dict()).to_dict(), ignore_unknown=True) == \
        Config.from_name("gpt2-medium", n_inner=3000, activation_function="gelu")


def test_an_ffn_only_config_has_no_heads_to_check():
    """Regression (issue 12): an FFN has no heads, so n_embd need not divide by n_head until attention is built."""
    from gpt2ffn import FeedForward
    from gpt2ffn.model import GPT2, Block
    assert Config(n_embd=200, n_inner=600).hidden == 600
    assert FeedForward({"n_embd": 200, "n_inner": 600}).c_fc.weight.shape == (200, 600)
    book = {**GPT_CONFIG_124M, "emb_dim": 100}
    assert FeedForward(book).c_proj.weight.shape == (400, 100)
    for build in (GPT2, Block):
        with pytest.raises(ConfigError, match="Config.n_embd=100 must divide by n_head=12: attention splits"):
            build(Config.from_dict(book))
