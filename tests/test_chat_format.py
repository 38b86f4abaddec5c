"""How the server reads each family's chat template (orca_mq.api.chat_format) and constrains a required
tool choice in its format (orca_mq.api.tool_grammar), without a server: every published template
(tests/data/chat_templates) names its parsers, whether it renders tools and opens the thinking itself;
each format's grammar, compiled over the family's vocabulary, takes the calls the family's own
template writes (several where the format holds several) and refuses a tool not given; a request with
tools on a server that parses none is a 400; Mistral's call ids are made ones its templates take."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from orca_mq.api.chat_format import ChatFormat, resolve
from orca_mq.api.errors import ApiError
from orca_mq.api.schemas import ChatCompletionRequest
from orca_mq.api.tool_grammar import constraint
from orca_mq.api.tools import Tool
from orca_mq.config import load_config
from orca_mq.protocol.structured import StructuredOutputsParams
from orca_mq.structured.compiler import Compiler
from orca_mq.structured.grammar import Vocabulary
from template_families import CALLS, FAMILIES, TOOLS, assistant, tokenizer, written

CFG = load_config()
TOOLED = [n for n, f in FAMILIES.items() if f.tool_parser]


def fmt_of(name: str) -> ChatFormat:
    return resolve(CFG, tokenizer(name))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_template_names_its_parsers_and_how_it_takes_tools(name):
    fam, fmt = FAMILIES[name], fmt_of(name)
    # a template that renders no tool format gets orca-mq's own system message, read by hermes
    assert (fmt.tool_parser, fmt.template_tools) == ((fam.tool_parser, True) if fam.tool_parser else ("hermes", False))
    assert fmt.reasoning_parser == fam.reasoning_parser
    assert fmt.opens_thinking == (name == "deepseek-r1-distill-qwen")
    # every marker is a special token in these vocabularies: the parsers need them kept (Gemma's, Phi's have none)
    assert fmt.keeps_specials == bool(fam.tool_parser or fam.reasoning_parser)


def _harmony_call(name: str, args: dict) -> str:
    return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{json.dumps(args)}"


@pytest.mark.parametrize("name", TOOLED)
def test_the_grammar_of_each_format_takes_what_the_familys_template_writes(name):
    fam, tok = FAMILIES[name], tokenizer(name)
    fmt = dataclasses.replace(fmt_of(name), compact_json=False)   # the templates write JSON with spaces
    calls = CALLS[:fam.calls_per_message]
    text = _harmony_call(*calls[0]) if name == "gpt-oss" else written(name, assistant(calls))[1]
    text = re.sub(r"^<think>.*?</think>\s*", "", text, flags=re.S)   # Qwen3's renders an empty thinking
    compiler = Compiler(CFG.structured, lambda: Vocabulary.of(tok, len(tok), [tok.eos_token_id], 1))
    tools = [Tool.model_validate(t) for t in TOOLS]

    def takes(text: str, thinking: bool) -> bool:
        grammar = compiler.compile(StructuredOutputsParams.from_dict(constraint(fmt, tools, True, thinking)))
        ids = tok.encode(text, add_special_tokens=False)
        return all(grammar.matcher.consume_token(t) for t in ids) and grammar.matcher.is_accepting()

    assert takes(text, thinking=True) and takes(text, thinking=False), text
    assert not takes(text.replace("get_time", "get_tame").replace("get_weather", "get_wether"), thinking=False)
    thought = {"think": "<think>\nLet me see.\n</think>\n\n", "gpt_oss": "<|channel|>analysis<|message|>Let me see.<|end|><|start|>assistant"}
    if fam.reasoning_parser in thought:   # the thinking may come first
        assert takes(thought[fam.reasoning_parser] + text, thinking=True)
        assert not takes(thought[fam.reasoning_parser] + text, thinking=False)


def test_a_server_that_parses_no_tools_refuses_them():
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS})
    with pytest.raises(ApiError) as refused:
        body.bind(ChatFormat(None, None, False))
    assert refused.value.status == 400 and refused.value.param == "tools"
    body.bind(ChatFormat("hermes", None, False))   # without tools, any format serves


def test_mistral_call_ids_are_nine_letters_or_digits_the_same_every_time():
    fmt = ChatFormat("mistral", None, True)
    made = fmt.call_id("call_8f2b3c")
    assert re.fullmatch(r"[A-Za-z0-9]{9}", made) and made == fmt.call_id("call_8f2b3c") != fmt.call_id("call_other")
    assert fmt.call_id("a1b2c3d4e") == "a1b2c3d4e" and ChatFormat("hermes", None, True).call_id("call_x") == "call_x"


def test_the_parsers_are_chosen_on_the_command_line_as_vllms_flags():
    from orca_mq.cli import _config, build_parser

    server = _config(build_parser().parse_args(["serve", "--tool-call-parser", "mistral", "--reasoning-parser", "none"])).server
    assert (server.tool_call_parser, server.reasoning_parser) == ("mistral", "none")
    with pytest.raises(SystemExit, match="gpt_oss"):   # harmony's parser reads both: it pairs with itself
        _config(build_parser().parse_args(["serve", "--tool-call-parser", "gpt_oss", "--reasoning-parser", "think"]))
