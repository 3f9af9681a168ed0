"""Incremental detokenization: the text of a growing list of token ids, decoded without
decoding everything again for every token; the scheduler's output text with stop
strings (`TextTracker`), and the one-piece-per-token split of fixed-cadence streaming
(`TokenSplitter`), both on the same decoder."""

from __future__ import annotations

from collections.abc import Callable
from os.path import commonprefix
from typing import TYPE_CHECKING

from speculant.requests import RequestError

if TYPE_CHECKING:
    from speculant.models.model import Model
    from speculant.requests import StreamChunk


class IncrementalDecoder:
    """The text of `ids` (append to it freely), always equal to decoding every id at once.

    The text of ids[:frozen] is kept, and only the tail after it is decoded again. The
    frozen point moves forward only to a split where decoding the two sides apart gives
    the same text as decoding them together (a whole UTF-8 character, no space a
    tokenizer strips or cleans up across the split), so a token costs the decode of a
    bounded tail instead of the whole output."""

    TAIL = 16  # tokens kept undecided behind the newest one

    def __init__(self, decode: Callable[[list[int]], str] | None) -> None:
        self.decode = decode  # None: no tokenizer, the text stays ""
        self.ids: list[int] = []
        self._text = ""
        self._decoded = 0  # len(ids) when _text was decoded
        self._frozen = 0  # ids[:_frozen] decode to _frozen_text, whatever follows
        self._frozen_text = ""

    @property
    def current(self) -> str | None:
        """The text if it is up to date with ids (no decode), else None."""
        return self._text if self._decoded == len(self.ids) else None

    @property
    def text(self) -> str:
        decode = self.decode
        if self._decoded != len(self.ids) and decode is not None:
            tail = decode(self.ids[self._frozen :])
            self._text = self._frozen_text + tail
            self._decoded = len(self.ids)
            if len(self.ids) - self._frozen >= 2 * self.TAIL:
                cut = len(self.ids) - self.TAIL
                head = decode(self.ids[self._frozen : cut])
                if tail.startswith(head) and decode(self.ids[cut:]) == tail[len(head) :]:
                    self._frozen, self._frozen_text = cut, self._frozen_text + head
        return self._text


class TextTracker:
    """Decoded output text, stop-string detection, and what is safe to stream so far
    (special tokens skipped; the text is decoded incrementally, see IncrementalDecoder).
    The text is decoded once per step (when it is released), or once per token only
    when stop strings must be checked token by token."""

    def __init__(self, model: Model, stop: tuple[str, ...]) -> None:
        self.tokenizer = model.tokenizer
        self.stop = stop
        tok = self.tokenizer
        self.decoder = IncrementalDecoder(
            (lambda ids: tok.decode(ids, skip_special_tokens=True)) if tok is not None else None
        )
        self.ids = self.decoder.ids
        self.cut: int | None = None  # index of a found stop string
        self.released = 0
        if stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer, and this model has none")

    @property
    def text(self) -> str:
        return self.decoder.text

    def push(self, token: int) -> bool:
        """Add a token; True when a stop string is now complete."""
        before = self.decoder.current
        self.ids.append(token)
        if not self.stop:
            return False
        text = self.text
        # An occurrence inside the text that was already searched and did not change
        # would have been found then: search from where a stop string could overlap the
        # changed tail (the new token's text, however long, and any character the new
        # token completed).
        lo = 0
        if before is not None:
            stable = len(before) if text.startswith(before) else len(commonprefix([before, text]))
            lo = max(0, stable - max(len(s) for s in self.stop) + 1)
        hits = [i for s in self.stop if (i := text.find(s, lo)) >= 0]
        if hits:
            self.cut = min(hits)
            return True
        return False

    def final_text(self) -> str:
        text = self.text
        return text if self.cut is None else text[: self.cut]

    def release(self, final: bool) -> str:
        """Text that can no longer change: hold back an incomplete UTF-8 character and any
        tail that could still grow into a stop string."""
        text = self.final_text()
        end = len(text)
        if not final and self.cut is None:
            if text.endswith("\ufffd"):
                end = len(text.rstrip("\ufffd"))
            for s in self.stop:
                for n in range(min(len(s) - 1, end), 0, -1):
                    if text[:end].endswith(s[:n]):
                        end = min(end, len(text[:end]) - n)
                        break
        if end <= self.released:
            return ""
        out = text[self.released : end]
        self.released = end
        return out


class TokenSplitter:
    """Turns engine chunks (several tokens, text released so far) into one piece of
    text per token. The pieces add up exactly to the engine's released text."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decoder = IncrementalDecoder(decode)
        self.released = ""  # all text the engine has released
        self.sent = 0  # characters of `released` already handed out

    def split(self, chunk: StreamChunk) -> list[str]:
        """One string per token of the chunk (the last one also takes any text the
        engine released beyond what its prefix decodes to)."""
        self.released += chunk.text
        pieces = []
        for token in chunk.token_ids:
            self.decoder.ids.append(token)
            prefix = self.decoder.text.rstrip("\ufffd")
            bound = min(len(self.released), max(self.sent, len(prefix)))
            pieces.append(self.released[self.sent : bound])
            self.sent = bound
        if not chunk.token_ids:
            pieces.append("")
        pieces[-1] += self.released[self.sent :]
        self.sent = len(self.released)
        return pieces
