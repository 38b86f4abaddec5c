"""A request's prompt -> token ids (the one place the chat template is applied): a size check in O(1)
first, then the tokenizer (or chat template), which the frontend runs off its event loop.

The size bound is derived from the context length: no token of the vocabulary covers more than
`longest_token` characters, so a prompt longer than max_model_len x longest_token characters
cannot fit and is refused before anything reads it.

Encoding goes through the Rust tokenizer's `encode_batch`, which releases the GIL (its `encode`
and transformers' wrapper hold it for the whole call): a long prompt on a thread then leaves the
event loop running.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from orca_mq.errors import InvalidRequest
from orca_mq.protocol.client_msgs import Generate

ROLES = ("system", "user", "assistant", "tool", "developer")   # OpenAI's chat roles; the template renders them


def check_prompt_size(prompt: str | None, prompt_token_ids: list[int] | None, messages: list[Any] | None,
                      max_model_len: int, max_chars: int) -> None:
    """Refuse, before tokenizing, what cannot fit `max_model_len` tokens: a token covers at most
    `max_chars // max_model_len` characters (the vocabulary's longest token) and a message at least one token."""
    if prompt_token_ids is not None and len(prompt_token_ids) > max_model_len:
        raise InvalidRequest(f"prompt has {len(prompt_token_ids)} tokens; the context length is {max_model_len}")
    if prompt is not None and len(prompt) > max_chars:
        raise InvalidRequest(f"prompt of {len(prompt)} characters cannot fit the context length "
                             f"of {max_model_len} tokens (at most {max_chars} characters)")
    if messages is not None:
        if len(messages) > max_model_len:
            raise InvalidRequest(f"{len(messages)} messages cannot fit the context length of {max_model_len} tokens")
        chars = sum(len(v) for m in messages if isinstance(m, dict) for v in m.values() if isinstance(v, str))
        if chars > max_chars:
            raise InvalidRequest(f"messages of {chars} characters cannot fit the context length "
                                 f"of {max_model_len} tokens (at most {max_chars} characters)")


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    return max(1, max(map(len, tokenizer.get_vocab())))


@dataclass(slots=True)
class Prompts:
    tokenizer: PreTrainedTokenizerBase
    max_model_len: int
    max_chars: int          # max_model_len x the longest token's characters

    @classmethod
    def for_model(cls, tokenizer: PreTrainedTokenizerBase, max_model_len: int) -> "Prompts":
        return cls(tokenizer, max_model_len, max_model_len * longest_token_chars(tokenizer))

    def check(self, msg: Generate) -> None:
        """Cheap checks, on the event loop: exactly one kind of prompt, and a size that can fit."""
        given = [k for k in ("prompt", "prompt_token_ids", "messages") if getattr(msg, k) is not None]
        if len(given) != 1:
            raise InvalidRequest(f"give exactly one of prompt, prompt_token_ids, messages (got {given or 'none'})")
        if msg.prompt_token_ids is not None and msg.chat:
            raise InvalidRequest("chat=True needs prompt or messages, not prompt_token_ids")
        if msg.messages is None and not msg.chat and msg.prompt is not None and not msg.prompt:
            raise InvalidRequest("empty prompt")
        check_prompt_size(msg.prompt, msg.prompt_token_ids, msg.messages, self.max_model_len, self.max_chars)

    def token_ids(self, msg: Generate, special: bool | None = None) -> list[int]:
        """The tokenizer's work: call it off the event loop, after `check`. `special` (/tokenize's
        add_special_tokens) says whether the tokenizer adds its special tokens; None: to raw text, not to a
        chat template's."""
        if msg.prompt_token_ids is not None:
            return msg.prompt_token_ids
        if msg.messages is None and not msg.chat:
            return self.encode_text(msg.prompt or "", special is not False)
        return self.encode_chat(msg.messages if msg.messages is not None else [{"role": "user", "content": msg.prompt}],
                                special is True)

    def encode_chat(self, messages: list[dict[str, Any]], special: bool = False) -> list[int]:
        """The model's chat template, with the generation prompt (the one place it is applied)."""
        if not messages or not all(
            isinstance(m, dict) and set(m) == {"role", "content"} and isinstance(m["role"], str)
            and isinstance(m["content"], str) for m in messages
        ):
            raise InvalidRequest("messages must be a non-empty list of {'role': str, 'content': str}")
        if bad := next((m["role"] for m in messages if m["role"] not in ROLES), None):
            raise InvalidRequest(f"message role {bad[:40]!r} is not one of {', '.join(ROLES)}")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja raises for roles or orders the template forbids
            raise InvalidRequest(f"chat template: {e}") from None
        return self._encode(text, special)  # by default not: the template already holds any BOS

    def encode_text(self, text: str, special: bool = True) -> list[int]:
        """Raw completion text: the model's special tokens (BOS) only where its tokenizer adds them."""
        return self._encode(text, special)

    def decode(self, token_ids: list[int]) -> str:
        """Token ids -> text, special tokens kept (vLLM's /detokenize), without holding the GIL."""
        return self.tokenizer.backend_tokenizer.decode_batch([token_ids], skip_special_tokens=False)[0]

    def _encode(self, text: str, special: bool) -> list[int]:
        """= tokenizer.encode(text, add_special_tokens=special), without holding the GIL."""
        return self.tokenizer.backend_tokenizer.encode_batch([text], add_special_tokens=special)[0].ids
