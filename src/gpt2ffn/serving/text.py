"""Generated tokens to text: deltas that never show part of a stop string or half a character."""


def cut_at_stop(text: str, stop: list) -> tuple:
    """(text before the first stop string, whether one was found), as OpenAI's API returns it."""
    hits = [i for i in (text.find(st) for st in stop) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


class TextStream:
    """Turns generated tokens into text deltas that never show part of a stop string or half a character."""

    def __init__(self, decode, stop):
        self.decode, self.stop, self.tokens, self.sent = decode, stop, [], ""
        self.hold = max((len(s) for s in stop), default=1) - 1

    def push(self, token) -> tuple:
        """(new text safe to send, whether a stop string was hit)."""
        self.tokens.append(token)
        text, stopped = cut_at_stop(self.decode(self.tokens), self.stop)
        safe = text if stopped else text[:len(text) - self.hold] if self.hold else text
        safe = safe.rstrip("\ufffd") if not stopped else safe
        delta, self.sent = safe[len(self.sent):], max(self.sent, safe, key=len)
        return delta, stopped

    def finish(self) -> str:
        text, _ = cut_at_stop(self.decode(self.tokens), self.stop)
        delta, self.sent = text[len(self.sent):], text
        return delta
