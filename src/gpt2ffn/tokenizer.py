"""GPT-2's byte-level BPE tokenizer from a model directory, through the `tokenizers` package.

Models of the `random:` presets have no tokenizer of their own; `ByteTokenizer` gives them GPT-2's 256
single-byte tokens (ids 0..255 in GPT-2's own byte order), so the whole pipeline runs on real text.
"""

from pathlib import Path

from .errors import CheckpointError, Gpt2ffnError


def bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character map (OpenAI's encoder.py); its order is GPT-2's ids 0..255."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


class ByteTokenizer:
    """Each UTF-8 byte is one token: GPT-2's single-byte token for it. Ids >= 256 decode as [id]."""

    additive = True  # decode(a + b) == decode(a) + decode(b) when decode(a) ends a character (serving.service.Offsets)

    def __init__(self):
        self.byte_to_id = {b: i for i, b in enumerate(bytes_to_unicode())}
        self.id_to_byte = {i: b for b, i in self.byte_to_id.items()}

    def encode(self, text: str) -> list:
        return [self.byte_to_id[b] for b in text.encode("utf-8")]

    def token_bytes(self, i: int) -> bytes:
        """The bytes token i stands for (OpenAI's logprobs `bytes`): part of a character for some."""
        return bytes([self.id_to_byte[i]]) if i in self.id_to_byte else f"[{i}]".encode()

    def decode(self, ids) -> str:
        out, pending = [], bytearray()
        for i in ids:
            if i in self.id_to_byte:
                pending.append(self.id_to_byte[i])
            else:
                out.append(pending.decode("utf-8", errors="replace") + f"[{i}]")
                pending = bytearray()
        return "".join(out) + pending.decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizers.Tokenizer with list-in, list-out encode/decode."""

    def __init__(self, tok):
        self.tok = tok
        from tokenizers import decoders
        # byte-level (GPT-2's): the tokens' bytes, then UTF-8, so decoding is additive where a character ends
        self.additive = isinstance(tok.decoder, decoders.ByteLevel)

    def encode(self, text: str) -> list:
        return self.tok.encode(text).ids

    def token_bytes(self, i: int) -> bytes:
        """The bytes token i stands for (OpenAI's logprobs `bytes`): a byte-level token's own bytes (part of a
        character for some), else its text's UTF-8."""
        piece = self.tok.id_to_token(i)
        if self.additive and piece is not None and all(c in UNICODE_TO_BYTE for c in piece):
            return bytes(UNICODE_TO_BYTE[c] for c in piece)
        return self.decode([i]).encode("utf-8")

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))


def has_tokenizer_files(directory) -> bool:
    """Whether `directory` holds a tokenizer load_tokenizer reads: tokenizer.json, or vocab.json + merges.txt."""
    d = Path(directory)
    return (d / "tokenizer.json").is_file() or ((d / "vocab.json").is_file() and (d / "merges.txt").is_file())


def load_tokenizer(directory):
    """From `tokenizer.json`, or from `vocab.json` + `merges.txt` (GPT-2's files)."""
    directory = Path(directory)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise Gpt2ffnError("reading a tokenizer needs the tokenizers package: pip install 'gpt2ffn[hf]'") from None
    if (directory / "tokenizer.json").is_file():
        try:
            return HFTokenizer(Tokenizer.from_file(str(directory / "tokenizer.json")))
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
        return HFTokenizer(tok)
    raise no_tokenizer(directory)


def no_tokenizer(directory) -> CheckpointError:
    """The error for a checkpoint directory with no tokenizer files."""
    return CheckpointError(f"no tokenizer in {directory}: need tokenizer.json, or vocab.json + merges.txt "
                           "(gpt2ffn generate and extract take the prompt as token ids with --ids instead; serve "
                           "with --skip-tokenizer-init takes and gives token ids)")
