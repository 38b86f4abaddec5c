"""The model families' published chat templates (tests/data/chat_templates, sources in SOURCES.md), each
with a tokenizer of its own special tokens, and what a model of the family writes: an assistant
message rendered by the family's template, less the generation prompt before it and the end-of-turn
token (the EOS the detokenizer hides) after it.

The tokenizers are byte-level BPEs trained in milliseconds on the family's own rendered text, the
family's markers each one special token as in the real vocabularies: their token boundaries fall
inside words and JSON as a real tokenizer's do.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from orca_mq.detokenizer import IncrementalDetokenizer
from orca_mq.tokenizer import Tokenizer as ServedTokenizer

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
WEATHER = {"type": "object", "required": ["city"], "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                           "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}]
NAMES = frozenset(t["function"]["name"] for t in TOOLS)
ASK = [{"role": "user", "content": "Weather in Paris and the time in Tokyo?"}]   # (Gemma's template takes no system role)
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "Asia/Tokyo \"JST\" → 東京"})]


@dataclass(frozen=True)
class Family:
    template: str                       # the file's stem in tests/data/chat_templates
    bos: str | None
    eos: str                            # the end-of-turn token the model ends with (hidden from the text)
    specials: tuple[str, ...]           # the family's markers, one token each in its vocabulary
    tool_parser: str | None             # what detect() must find
    reasoning_parser: str | None
    calls_per_message: int = 2          # Llama's templates render one call per message, gpt-oss's one too
    thinking_field: str | None = None   # the assistant message's field the template renders the thinking from
    takes_enable_thinking: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return (TEMPLATES / f"{self.template}.jinja").read_text()


QWEN = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<think>", "</think>")
LLAMA = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")
MISTRAL = ("<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
           "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[ARGS]", "[CALL_ID]", "[TOOL_CONTENT]")
HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>", "<|endoftext|>")
R1 = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>")
FAMILIES = {f.template: f for f in [
    Family("qwen2.5-instruct", None, "<|im_end|>", QWEN, "hermes", None),
    Family("qwen3", None, "<|im_end|>", QWEN, "hermes", "think", thinking_field="reasoning_content",
           takes_enable_thinking=True),
    Family("llama3.1-instruct", "<|begin_of_text|>", "<|eot_id|>", LLAMA, "llama3_json", None, calls_per_message=1),
    Family("llama3.2-instruct", "<|begin_of_text|>", "<|eot_id|>", LLAMA, "llama3_json", None, calls_per_message=1),
    Family("mistral-7b-instruct-v0.3", "<s>", "</s>", MISTRAL, "mistral", None),
    Family("mistral-nemo-instruct-2407", "<s>", "</s>", MISTRAL, "mistral", None),
    Family("mistral-small-3.2-instruct-2506", "<s>", "</s>", MISTRAL, "mistral", None),
    Family("devstral-small-2507", "<s>", "</s>", MISTRAL, "mistral", None),
    Family("gpt-oss", "<|startoftext|>", "<|call|>", HARMONY, "gpt_oss", "gpt_oss", calls_per_message=1,
           thinking_field="thinking"),
    Family("deepseek-r1-distill-qwen", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", R1, None, "think"),
    Family("gemma2-it", "<bos>", "<end_of_turn>", ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"), None, None),
    Family("phi3.5-mini-instruct", "<s>", "<|end|>", ("<s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>",
                                                        "<|system|>"), None, None),
]}


@functools.cache
def tokenizer(name: str) -> ServedTokenizer:
    """The family's tokenizer as the server holds it (transformers' made into orca_mq.tokenizer's)."""
    return ServedTokenizer.of(hf_tokenizer(name))


@functools.cache
def hf_tokenizer(name: str) -> PreTrainedTokenizerFast:
    fam = FAMILIES[name]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [fam.text, json.dumps(TOOLS), json.dumps(CALLS, ensure_ascii=False)]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=600, special_tokens=list(fam.specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=fam.bos, eos_token=fam.eos, chat_template=fam.text)


def render(name: str, messages: list[dict[str, Any]], generation: bool, **kwargs: Any) -> str:
    return tokenizer(name).render_chat(messages, TOOLS, generation, **kwargs)


def assistant(calls: list[tuple[str, dict[str, Any]]], content: str = "", thinking: str | None = None,
              fam: Family | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": f"call{i:05d}", "type": "function", "function": {"name": n, "arguments": a}}
                                 for i, (n, a) in enumerate(calls)]
    if thinking is not None and fam is not None and fam.thinking_field:
        message[fam.thinking_field] = thinking
    return message


def written(name: str, message: dict[str, Any], **kwargs: Any) -> tuple[str, str]:
    """(the prompt, what the model writes after it): `message` rendered after ASK, less the prompt and
    the end-of-turn token."""
    fam = FAMILIES[name]
    prompt = render(name, ASK, True, **kwargs)
    full = render(name, [*ASK, message], False, **kwargs)
    assert full.startswith(prompt), (prompt[-200:], full[-400:])
    out = full[len(prompt):].rstrip("\n")
    for end in (fam.eos, "<|return|>"):
        out = out.removesuffix(end)
    return prompt, out.rstrip(" ") if fam.tool_parser == "mistral" else out


def token_pieces(name: str, text: str) -> list[str]:
    """`text` as the frontend streams it: tokenized, then detokenized one token at a time (special
    tokens kept)."""
    tok = tokenizer(name)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    pieces = [detok.step([i]) for i in tok.encode(text, add_special_tokens=False)]
    return [*pieces, detok.finish()]
