"""Reasoning and tool-call parsers: a model's output text -> content, reasoning_content and tool_calls,
in the format each family was trained on, streamed or not with the same result on every cut.

    parser = output_parser("hermes", "think", tools={"get_weather"}, prompt=rendered_prompt)
    for piece in pieces:               # the detokenized text, special tokens kept
        delta = parser.feed(piece)     # Delta(content, reasoning, calls)
    delta = parser.finish(finish_reason)

`parse_all(parser, text, reason)` is the unstreamed parse (the same code fed once); `detect(template)`
names the parsers a chat template calls for. Formats: hermes.py, llama3.py, mistral.py, harmony.py
(gpt-oss, reasoning too), reasoning.py (<think>); scan.py holds what they share.
"""
from orca_mq.api.parsers.delta import Call, CallDelta, Delta, Parsed, finish_reason
from orca_mq.api.parsers.registry import (REASONING_PARSERS, TOOL_PARSERS, Detected, OutputParser, ReasoningParserName,
                                          ToolParserName, detect, output_parser)
from orca_mq.api.parsers.scan import parse_all

__all__ = ["Call", "CallDelta", "Delta", "Detected", "OutputParser", "Parsed", "REASONING_PARSERS", "ReasoningParserName",
           "TOOL_PARSERS", "ToolParserName", "detect", "finish_reason", "output_parser", "parse_all"]
