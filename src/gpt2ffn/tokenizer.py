"""GPT-2's byte-level BPE tokenizer from a model directory, through the `tokenizers` package."""

from pathlib import Path

from .errors import CheckpointError, Gpt2ffnError


def load_tokenizer(directory):
    """A tokenizers.Tokenizer from `tokenizer.json`, or from `vocab.json` + `merges.txt` (GPT-2's files)."""
    directory = Path(directory)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise Gpt2ffnError("reading a tokenizer needs the tokenizers package: pip install 'gpt2ffn[hf]'") from None
    if (directory / "tokenizer.json").is_file():
        try:
            return Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as e:
            raise CheckpointError(f"{directory / 'tokenizer.json'} is not a valid tokenizer file: {e}") from None
    if (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
        from tokenizers import decoders, models, pre_tokenizers
        try:
            bpe = models.BPE.from_file(str(directory / "vocab.json"), str(directory / "merges.txt"))
        except Exception as e:
            raise CheckpointError(f"{directory}: vocab.json/merges.txt could not be read: {e}") from None
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return tok
    raise CheckpointError(f"no tokenizer in {directory}: need tokenizer.json, or vocab.json + merges.txt "
                          "(or pass token ids with --ids)")
