"""Generated tokens to text: deltas that never show part of a stop string or half a character."""


def cut_at_stop(text: str, stop: list, start: int = 0) -> tuple:
    """(text before the first stop string, whether one was found), as OpenAI's API returns it; stop strings are
    looked for from `start` on."""
    hits = [i for i in (text.find(st, start) for st in stop) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


class TextStream:
    """Turns generated tokens into text deltas that never show part of a stop string or half a character.

    Decoding is incremental (as vLLM's and TGI's detokenizers): a new token is decoded together with the few
    before it (their text, decoded again, is the context it is cut from), and the text grows only by whole
    characters; tokens that end in half a UTF-8 character wait for the rest. So each token costs the decode of a
    few tokens, not of everything generated so far (that was 103 us a token at 1024 tokens), and stop strings
    are looked for only where the new text could complete one. With a tokenizer whose decoding is additive where
    a character ends (`additive`, as byte-level BPE's: by default the decode method's tokenizer says), the
    context's text is the text so far, so only the new tokens are decoded."""

    def __init__(self, decode, stop, additive: bool | None = None):
        if additive is None:
            additive = bool(getattr(getattr(decode, "__self__", None), "additive", False))
        self.decode, self.stop, self.tokens, self.additive = decode, stop, [], additive
        self.prefix = self.read = 0  # tokens[prefix:read]: already in text, decoded again as the context
        self.text = ""               # whole characters decoded so far
        self.sent = 0                # characters of text returned so far
        self.hold = max((len(s) for s in stop), default=1) - 1

    def _decode_new(self, final: bool = False) -> str:
        """Decode the tokens after `read`: their text joins self.text unless they end in half a character (then,
        unless final, they wait); -> the text now known, self.text and the whole characters of the waiting ones."""
        if self.additive:  # the context's text ends a character: the new tokens' text follows it unchanged
            context, new = "", self.decode(self.tokens[self.read:])
        else:
            context = self.decode(self.tokens[self.prefix:self.read])
            new = self.decode(self.tokens[self.prefix:])
        if final or (len(new) > len(context) and not new.endswith("\ufffd")):
            self.text += new[len(context):]
            self.prefix, self.read = self.read, len(self.tokens)
            return self.text
        return self.text + new[len(context):].rstrip("\ufffd")

    def push(self, token) -> tuple:
        """(new text safe to send, whether a stop string was hit)."""
        self.tokens.append(token)
        known = self._decode_new()
        if not self.stop:
            stopped, safe = False, len(known)
        else:  # a stop string starts at or after what was sent (what could start one was held back)
            text, stopped = cut_at_stop(known, self.stop, max(0, self.sent - self.hold))
            safe = len(text) if stopped else len(known) - self.hold
        if safe <= self.sent:
            return "", stopped
        delta, self.sent = known[self.sent:safe], safe
        return delta, stopped

    def finish(self) -> str:
        """The rest: what was held back, and half a character at the end (as U+FFFD), up to a stop string."""
        self._decode_new(final=True)
        text, _ = cut_at_stop(self.text, self.stop)
        delta, self.sent = text[self.sent:], max(self.sent, len(text))
        return delta
