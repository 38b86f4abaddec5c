"""Incremental detokenization for streaming.

Decoding one token at a time breaks multi-byte characters (a CJK character or an emoji is often
split over several byte-level tokens). Each step decodes a short window of the generated ids —
from the start of the last emitted piece — and emits only the new suffix, holding it back while
it ends in U+FFFD (an incomplete character). At the end the full ids are decoded once, so the
streamed pieces always concatenate to exactly `tokenizer.decode(all_ids)`.
"""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.emitted: list[str] = []
        self._prefix_offset = 0   # window start: the ids of the last emitted piece
        self._read_offset = 0     # ids up to here are already in emitted text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def step(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly stable text (may be empty)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        text = self._decode(self.ids[self._prefix_offset:])
        if len(text) <= len(prefix) or text.endswith(REPLACEMENT):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        delta = text[len(prefix):]
        self.emitted.append(delta)
        return delta

    def finish(self) -> str:
        """The remaining text, so that everything emitted equals the full decode."""
        full = self._decode(self.ids)
        done = "".join(self.emitted)
        delta = full[len(done):] if full.startswith(done) else ""
        self.emitted.append(delta)
        return delta
