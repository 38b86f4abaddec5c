"""The vocabulary's tokens as bytes (`Tables`, one per Vocabulary) and where JSON text stands after
its bytes (`JsonLex`): what budget-aware closing (orca_mq.structured.budget) plans with, and the
masks of the tokens that keep a number within `structured.max_number_digits` digits or open nothing."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
from llguidance import LLTokenizer

from orca_mq.protocol.iteration import MASK_WORD_BITS

QUOTE, BACKSLASH, COMMA, COLON, MINUS, OPEN_OBJECT = 0x22, 0x5C, 0x2C, 0x3A, 0x2D, 0x7B
OPEN, CLOSE = frozenset(b"{["), frozenset(b"}]")
DIGITS = frozenset(b"0123456789")
NUMBER = frozenset(b"0123456789+-.eE")
NEEDS_DIGIT = frozenset(b"+-.eE")   # a number ending here is incomplete: one more digit is due
RUNS = re.compile(rb"[0-9+\-.eE]+")
OPENERS = frozenset(b'{[,":')       # outside a string, what may begin more to close


@dataclass(slots=True)
class JsonLex:
    """Where JSON text stands after its bytes so far."""
    in_string: bool = False
    escaped: bool = False
    digits: int = -1          # digits of the number the text ends in; -1: it does not end in one
    last: int = -1            # its last byte
    open: str = ""            # the containers open, innermost last: { or [
    key: bool = False         # the string open, or the next, is an object's key

    def feed(self, data: bytes) -> None:
        if data:
            self.last = data[-1]
        for b in data:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif b == BACKSLASH:
                    self.escaped = True
                elif b == QUOTE:
                    self.in_string = False
                continue
            number = b in DIGITS or b == MINUS or self.digits >= 0 and b in NUMBER   # not true's e
            self.digits = max(self.digits, 0) + (b in DIGITS) if number else -1
            if b == QUOTE:
                self.in_string = True
            elif b in OPEN:
                self.open, self.key = self.open + chr(b), b == OPEN_OBJECT
            elif b in CLOSE:
                self.open, self.key = self.open[:-1], False
            elif b == COMMA:
                self.key = self.open[-1:] == "{"
            elif b == COLON:
                self.key = False

    def copy(self) -> "JsonLex":
        return JsonLex(self.in_string, self.escaped, self.digits, self.last, self.open, self.key)


@dataclass(slots=True)
class Tables:
    """The vocabulary's tokens as bytes, for spelling plans and bounding digits; one per Vocabulary."""
    token_bytes: list[bytes]             # b"" for special tokens (EOS among them)
    by_bytes: dict[bytes, int]           # a token of each byte string the vocabulary spells
    longest: list[int]                   # by first byte: the longest token that starts with it
    byte_token: list[int]                # the token of each single byte; -1: none
    eos: int
    size: int                            # the mask's width in tokens
    calm: np.ndarray                     # [outside a string, inside]: the tokens that open nothing (mask words)
    _digit_masks: dict[int, np.ndarray] = field(default_factory=dict)

    @classmethod
    def of(cls, tok: LLTokenizer, size: int) -> "Tables":
        token_bytes = [b"" if tok.is_special_token(t) else tok.decode_bytes([t]) for t in range(tok.vocab_size)]
        by_bytes: dict[bytes, int] = {}
        longest = [0] * 256
        for t, b in enumerate(token_bytes):
            if b:
                by_bytes.setdefault(b, t)
                longest[b[0]] = max(longest[b[0]], len(b))
        calm = np.ones((2, size), dtype=bool)   # outside: no member, item, key, string or container begins;
        for t, b in enumerate(token_bytes):
            calm[0, t], calm[1, t] = not OPENERS.intersection(b), QUOTE not in b   # inside: the string goes on
        return cls(token_bytes, by_bytes, longest, [by_bytes.get(bytes([b]), -1) for b in range(256)], tok.eos_token,
                   size, _words(calm))

    def spell(self, data: bytes) -> list[int] | None:
        """`data` in tokens, longest first (None: a byte no token spells)."""
        out, i, n = [], 0, len(data)
        while i < n:
            for j in range(min(n, i + self.longest[data[i]]), i, -1):
                if (t := self.by_bytes.get(data[i:j])) is not None:
                    out.append(t)
                    i = j
                    break
            else:
                return None
        return out

    def digit_masks(self, max_digits: int) -> np.ndarray:
        """Row n (0..max_digits): the tokens allowed outside a string after text that ends in a
        number of n digits (or in none: row 0) so that no number gets more than `max_digits`, a
        digit still due counted; int32 words, the mask's format. Conservative where a token holds a
        string: a subset of the tokens that keep the bound."""
        masks = self._digit_masks.get(max_digits)
        if masks is None:
            lead = np.zeros(self.size, dtype=np.int32)    # digits a token adds to the number it continues
            inner = np.zeros(self.size, dtype=np.int32)   # the most digits of a number it starts
            for t, b in enumerate(self.token_bytes):
                for run in RUNS.finditer(b):
                    n = sum(c in DIGITS for c in run.group()) + (run.group()[-1] in NEEDS_DIGIT)
                    if run.start() == 0:
                        lead[t] = n
                    else:
                        inner[t] = max(inner[t], n)
            ok = (lead[None, :] <= max_digits - np.arange(max_digits + 1)[:, None]) & (inner <= max_digits)
            masks = self._digit_masks[max_digits] = _words(ok)
        return masks


def _words(ok: np.ndarray) -> np.ndarray:
    """Rows of booleans by token -> rows of the mask's int32 words."""
    bits = np.packbits(ok, axis=1, bitorder="little")
    return np.pad(bits, ((0, 0), (0, -bits.shape[1] % (MASK_WORD_BITS // 8)))).view(np.int32)
