"""A constraint -> an llguidance grammar, checked, cached and bounded; with the model's vocabulary,
a per-request `Grammar`.

`Compiler.check` needs no vocabulary: the grammar is built and validated, which catches every error in
the schema, regex or grammar. With the vocabulary (built once per process, on the first constrained
request), the frontend finds the shortest output a constraint allows (`Compiler.shortest`, once per
constraint: admission refuses a max_tokens that cannot hold it) and the scheduler compiles
(`Compiler.compile`) with the shortest plan the frontend found (`Known`: searched once, not again).
Both run in a thread of their own (`bounded`), never on an event loop, the compute thread or the
frontend's tokenize threads: a constraint is bounded in size (`structured.max_spec_bytes`) before any
work, in work by llguidance's own limits, and in time by `structured.compile_timeout`, which also
stops the search where it is (budget.OutOfTime), so the thread is free for the next constraint.
Compiled constraints are cached by their text (LRU, `structured.cache_size`); a request's matcher is
a copy of the cached one (microseconds).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, TypeVar

import llguidance
from llguidance import LLMatcher

from orca_mq.errors import InvalidRequest
from orca_mq.structured.budget import OutOfTime, shortest
from orca_mq.structured.grammar import LIMITS, Grammar, Vocabulary
from orca_mq.protocol.structured import StructuredOutputsParams

if TYPE_CHECKING:
    from orca_mq.config import StructuredConfig

T = TypeVar("T")
ANY_OBJECT = '{"type":"object"}'
MAX_ERROR_CHARS = 300   # llguidance's messages quote the grammar: keep what a client sees short


def _bad(spec: StructuredOutputsParams, why: str) -> InvalidRequest:
    why = " ".join(why.split())   # llguidance's messages span lines
    return InvalidRequest(f"invalid structured_outputs.{spec.kind}: "
                          f"{why if len(why) <= MAX_ERROR_CHARS else why[:MAX_ERROR_CHARS] + '...'}")


@dataclass(frozen=True, slots=True)
class Known:
    """A constraint's shortest plan from the start as the frontend found it (None: none found)."""
    tokens: list[int] | None


@dataclass(slots=True)
class _Entry:
    grammar: str                       # llguidance's grammar text
    template: LLMatcher | None = None  # a fresh matcher over the vocabulary, copied per request
    start: list[int] | None = None     # with it: the shortest plan from the start (None: none found)


class Compiler:
    """One per process. `vocabulary` builds the model's vocabulary (a few tenths of a second, most of it
    in llguidance holding the GIL) when first needed: a server builds it on its grammar thread once
    ready (`ServedModel.warm_grammars`), not under its first constrained request; None: check only."""

    def __init__(self, cfg: "StructuredConfig", vocabulary: Callable[[], Vocabulary] | None = None) -> None:
        self.cfg = cfg
        self._vocabulary = vocabulary
        self._vocab: Vocabulary | None = None
        self._cache: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._lock = threading.Lock()   # the cache is shared by the compile threads

    def check(self, spec: StructuredOutputsParams) -> None:
        """Raise InvalidRequest if the constraint is too large or does not compile."""
        self._entry(spec)

    def compile(self, spec: StructuredOutputsParams, known: Known | None = None, deadline: float | None = None) -> Grammar:
        """A new request's grammar state; `known`: its shortest plan, found already (else searched here)."""
        entry, vocab = self._compiled(spec, known, deadline)
        json = spec.kind in ("json", "json_object")
        return Grammar(spec.kind, entry.template.deep_copy(), vocab, start=entry.start,  # type: ignore[union-attr]
                       max_digits=self.cfg.max_number_digits if json else 0, margin=self.cfg.close_margin,
                       guard=self.cfg.close_guard if json else 0)   # what opens more is JSON's to say

    def shortest(self, spec: StructuredOutputsParams, deadline: float | None = None) -> int | None:
        """Check the constraint (as `check`), and the tokens of the shortest output found that it
        allows (None: none found); an EOS after it is not counted: cut there by max_tokens, the
        output is whole."""
        entry, vocab = self._compiled(spec, None, deadline)
        start = entry.start
        return None if start is None else len(start) - (start[-1:] == [vocab.tables.eos])

    def known(self, spec: StructuredOutputsParams) -> Known | None:
        """The shortest plan `shortest` found for it, while it is cached (None: not searched, or evicted)."""
        with self._lock:
            entry = self._cache.get((spec.kind, spec.spec()))
        return None if entry is None or entry.template is None else Known(entry.start)

    def vocabulary(self) -> Vocabulary:
        """The model's vocabulary, built on first use."""
        with self._lock:
            if self._vocab is None:
                if self._vocabulary is None:
                    raise RuntimeError("this compiler has no vocabulary: it only checks constraints")
                self._vocab = self._vocabulary()
            return self._vocab

    def _compiled(self, spec: StructuredOutputsParams, known: Known | None,
                  deadline: float | None) -> tuple[_Entry, Vocabulary]:
        entry = self._entry(spec)
        vocab = self.vocabulary()
        if entry.template is None:
            template = LLMatcher(vocab.tokenizer, entry.grammar, log_level=0, limits=LIMITS)
            if template.is_error():  # what only the vocabulary reveals (e.g. a lexer too large for it)
                raise _bad(spec, template.get_error())
            try:
                entry.start = known.tokens if known is not None else shortest(template, vocab.tables, deadline)
            except OutOfTime:
                raise _bad(spec, f"did not compile within {self.cfg.compile_timeout} s (structured.compile_timeout)") from None
            entry.template = template
        return entry, vocab

    @property
    def cached(self) -> int:
        return len(self._cache)

    def _entry(self, spec: StructuredOutputsParams) -> _Entry:
        text = spec.spec()
        if len(text.encode()) > self.cfg.max_spec_bytes:
            raise _bad(spec, f"{len(text.encode())} bytes; at most {self.cfg.max_spec_bytes} (structured.max_spec_bytes)")
        key = (spec.kind, text)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                return entry
        entry = _Entry(self._grammar(spec, text))
        with self._lock:
            entry = self._cache.setdefault(key, entry)
            while len(self._cache) > self.cfg.cache_size:
                self._cache.popitem(last=False)
        return entry

    def _grammar(self, spec: StructuredOutputsParams, text: str) -> str:
        kind = spec.kind
        try:
            if kind in ("json", "json_object"):
                options = {"whitespace_flexible": self.cfg.json_whitespace == "flexible"}
                grammar = LLMatcher.grammar_from_json_schema(text or ANY_OBJECT, defaults=options)  # type: ignore[arg-type]
            elif kind == "regex":
                grammar = LLMatcher.grammar_from_regex(text)
            elif kind == "choice":
                grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
            else:
                grammar = llguidance.grammar_from("grammar", text)   # Lark, or GBNF converted to Lark
        except (ValueError, RecursionError) as e:
            raise _bad(spec, str(e)) from None
        error = LLMatcher.validate_grammar(grammar, None, limits=LIMITS)
        if error:
            raise _bad(spec, error)
        return grammar


async def bounded(executor: Executor, fn: Callable[..., T], spec: StructuredOutputsParams, timeout: float) -> T:
    """fn(spec, deadline=...) in a thread, refused (InvalidRequest) past `timeout` seconds. Waiting
    in the queue counts (a queued call that times out never runs); the search stops at the deadline
    itself, llguidance's own work at its work limits."""
    deadline = time.monotonic() + timeout
    future = asyncio.get_running_loop().run_in_executor(executor, lambda: fn(spec, deadline=deadline))
    try:
        return await asyncio.wait_for(future, timeout)
    except TimeoutError:
        raise _bad(spec, f"did not compile within {timeout} s (structured.compile_timeout)") from None
