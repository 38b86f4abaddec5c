"""A request's prompt -> token ids (the one place the chat template is applied): a size check in O(1)
first, then the tokenizer (or chat template), which the frontend runs off its event loop.

The size bound is derived from the context length: no token of the vocabulary covers more than
`longest_token` characters, so a prompt longer than max_model_len x longest_token characters
cannot fit and is refused before anything reads it.

A chat request may give the template more variables (`chat_template_kwargs`, vLLM's: e.g.
{"enable_thinking": false}); they are JSON of at most MAX_TEMPLATE_KWARGS_CHARS characters and may not
set the template's own arguments (TEMPLATE_ARGUMENTS: the messages, tools, generation prompt, ...).
It may give `tools` (OpenAI's function tools), which go to the template as transformers'
`apply_chat_template(tools=...)` passes them, and messages in OpenAI's shape with the fields the
families' templates read (an assistant's `tool_calls` and thinking, a tool result's `tool_call_id`).
A chat prompt's end (PROMPT_TAIL_CHARS) goes back with its first tokens: a reasoning parser reads from
it whether the output begins inside a thinking block the template opened.

Encoding releases the GIL (orca_mq.tokenizer): a long prompt on a thread leaves the event loop running.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from orca_mq.errors import InvalidRequest
from orca_mq.protocol.client_msgs import Generate

if TYPE_CHECKING:   # the HTTP API's schemas check template kwargs here, before any tokenizer is loaded
    from orca_mq.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool", "developer")   # OpenAI's chat roles; the template renders them
# a message's fields: text, but an assistant's earlier calls ({id, type, function: {name, arguments}})
TEXT_FIELDS = frozenset({"content", "name", "tool_call_id", "reasoning_content", "thinking"})
PROMPT_TAIL_CHARS = 256   # a chat prompt's end, sent back with its first tokens
MAX_TEMPLATE_KWARGS_CHARS = 16384   # chat_template_kwargs as JSON text: they bound the template's rendering work
# apply_chat_template's parameters and the names it renders the template with: kwargs may not replace them
TEMPLATE_ARGUMENTS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_template_kwargs(kwargs: Any) -> None:
    """chat_template_kwargs: a JSON object of at most MAX_TEMPLATE_KWARGS_CHARS characters, none of
    whose keys is one of TEMPLATE_ARGUMENTS."""
    if not isinstance(kwargs, dict):
        raise InvalidRequest("chat_template_kwargs must be an object", "chat_template_kwargs")
    if clash := sorted(TEMPLATE_ARGUMENTS.intersection(kwargs)):
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(map(repr, clash))}: the chat template's own "
                             "argument (give it as a request field where there is one)", "chat_template_kwargs")
    try:
        chars = len(json.dumps(kwargs))
    except (TypeError, ValueError, RecursionError):   # bytes from a msgpack client, too deep a nesting
        raise InvalidRequest("chat_template_kwargs must hold JSON values", "chat_template_kwargs") from None
    if chars > MAX_TEMPLATE_KWARGS_CHARS:
        raise InvalidRequest(f"chat_template_kwargs of {chars} characters as JSON (at most {MAX_TEMPLATE_KWARGS_CHARS})",
                             "chat_template_kwargs")


def check_prompt_size(prompt: str | None, prompt_token_ids: list[int] | None, messages: list[Any] | None,
                      max_model_len: int, max_chars: int, tools: list[Any] | None = None) -> None:
    """Refuse, before tokenizing, what cannot fit `max_model_len` tokens: a token covers at most
    `max_chars // max_model_len` characters (the vocabulary's longest token) and a message at least one token
    (the characters of every string in the messages and tools count, nested ones too)."""
    if prompt_token_ids is not None and len(prompt_token_ids) > max_model_len:
        raise InvalidRequest(f"prompt has {len(prompt_token_ids)} tokens; the context length is {max_model_len}", "prompt")
    if prompt is not None and len(prompt) > max_chars:
        raise InvalidRequest(f"prompt of {len(prompt)} characters cannot fit the context length "
                             f"of {max_model_len} tokens (at most {max_chars} characters)", "prompt")
    if messages is not None:
        if len(messages) > max_model_len:
            raise InvalidRequest(f"{len(messages)} messages cannot fit the context length of {max_model_len} tokens",
                                 "prompt")
        chars = text_chars([messages, tools])
        if chars > max_chars:
            raise InvalidRequest(f"messages of {chars} characters cannot fit the context length "
                                 f"of {max_model_len} tokens (at most {max_chars} characters)", "prompt")


def text_chars(value: Any) -> int:
    """The characters of every string (keys too) in nested lists and maps, without recursion (a frame's
    nesting is the sender's)."""
    chars, todo = 0, [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            chars += len(v)
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
    return chars


def check_messages(messages: Any) -> None:
    """A non-empty list of {role, content: str}, with the text fields of TEXT_FIELDS and an assistant's
    `tool_calls` (each {id?, type?, function: {name: str, arguments: object or JSON text}})."""
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        and m.keys() <= TEXT_FIELDS | {"role", "tool_calls"}
        and all(isinstance(m[k], str) for k in TEXT_FIELDS & m.keys()) and _calls_ok(m.get("tool_calls", []))
        for m in messages
    ):
        raise InvalidRequest(f"messages must be a non-empty list of {{'role': str, 'content': str}}, with optional "
                             f"{', '.join(sorted(TEXT_FIELDS - {'content'}))} (str) and tool_calls", "prompt")
    if bad := next((m["role"] for m in messages if m["role"] not in ROLES), None):
        raise InvalidRequest(f"message role {bad[:40]!r} is not one of {', '.join(ROLES)}", "prompt")


def _calls_ok(calls: Any) -> bool:
    return isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(f := c.get("function"), dict) and isinstance(f.get("name"), str)
        and isinstance(f.get("arguments", {}), (dict, str)) for c in calls)


def longest_token_chars(tokenizer: Tokenizer) -> int:
    return max(1, max(map(len, tokenizer.get_vocab())))


@dataclass(slots=True)
class Prompts:
    tokenizer: Tokenizer
    max_model_len: int
    max_chars: int          # max_model_len x the longest token's characters

    @classmethod
    def for_model(cls, tokenizer: Tokenizer, max_model_len: int) -> "Prompts":
        return cls(tokenizer, max_model_len, max_model_len * longest_token_chars(tokenizer))

    def check(self, msg: Generate) -> None:
        """Cheap checks, on the event loop: exactly one kind of prompt, and a size that can fit."""
        given = [k for k in ("prompt", "prompt_token_ids", "messages") if getattr(msg, k) is not None]
        if len(given) != 1:
            raise InvalidRequest(f"give exactly one of prompt, prompt_token_ids, messages (got {given or 'none'})")
        if msg.prompt_token_ids is not None and msg.chat:
            raise InvalidRequest("chat=True needs prompt or messages, not prompt_token_ids")
        if msg.messages is None and not msg.chat and msg.prompt is not None and not msg.prompt:
            raise InvalidRequest("empty prompt", "prompt")
        for name in ("chat_template_kwargs", "tools"):
            if getattr(msg, name) is not None and msg.messages is None and not msg.chat:
                raise InvalidRequest(f"{name} needs messages or chat=True (a chat template)", name)
        if msg.chat_template_kwargs is not None:
            check_template_kwargs(msg.chat_template_kwargs)
        check_prompt_size(msg.prompt, msg.prompt_token_ids, msg.messages, self.max_model_len, self.max_chars, msg.tools)

    def token_ids(self, msg: Generate, special: bool | None = None) -> list[int]:
        """The tokenizer's work: call it off the event loop, after `check`. `special` (/tokenize's
        add_special_tokens) says whether the tokenizer adds its special tokens; None: to raw text, not to a
        chat template's."""
        return self.tokenize(msg, special)[0]

    def tokenize(self, msg: Generate, special: bool | None = None) -> tuple[list[int], str | None]:
        """token_ids, and a chat prompt's last PROMPT_TAIL_CHARS characters (None: raw text or ids)."""
        if msg.prompt_token_ids is not None:
            return msg.prompt_token_ids, None
        if msg.messages is None and not msg.chat:
            return self.encode_text(msg.prompt or "", special is not False), None
        text = self.render(msg.messages if msg.messages is not None else [{"role": "user", "content": msg.prompt}],
                           msg.chat_template_kwargs, msg.tools)
        return self.tokenizer.encode(text, special is True), text[-PROMPT_TAIL_CHARS:]  # by default not: the template holds any BOS

    def encode_chat(self, messages: list[dict[str, Any]], special: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        return self.tokenizer.encode(self.render(messages, template_kwargs), special)

    def render(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The model's chat template, with the generation prompt (the one place it is applied), `tools`
        and any variables of `template_kwargs` (checked by check_template_kwargs)."""
        check_messages(messages)
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise InvalidRequest("tools must be a list of objects (OpenAI's function tools)", "tools")
        try:
            return self.tokenizer.render_chat(messages, tools or None, True, **(template_kwargs or {}))
        except Exception as e:  # jinja raises for roles or orders the template forbids
            raise InvalidRequest(f"chat template: {e}", "prompt") from None

    def encode_text(self, text: str, special: bool = True) -> list[int]:
        """Raw completion text: the model's special tokens (BOS) only where its tokenizer adds them."""
        return self.tokenizer.encode(text, special)

    def decode(self, token_ids: list[int]) -> str:
        """Token ids -> text, special tokens kept (vLLM's /detokenize)."""
        return self.tokenizer.decode(token_ids)
