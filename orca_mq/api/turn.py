"""A request of the Responses or Messages API as the chat request it stands for: one choice, run by the
chat path (orca_mq.api.fanout) and read by the model's parsers (orca_mq.api.reply), shown by its API's
View whole (`shown`: the reply fed to the view as one delta) or streamed (`events`: each delta as it
comes). The views differ only in how they show deltas and the end: the request, the engine and the
parsing are the chat API's."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from orca_mq.api.errors import ApiError
from orca_mq.api.fanout import Fanout, begin
from orca_mq.api.offload import weight
from orca_mq.api.parsers import CallDelta, Delta, Parsed
from orca_mq.api.reply import Reply
from orca_mq.api.schemas import Usage
from orca_mq.api.stream import until_disconnect


class View:
    """An API's response made of the reply's deltas (each method returns its server-sent events): a delta's
    thinking and answer go to the view's text parts of those kinds, each call to its own."""

    THINKING: str
    ANSWER: str

    def start(self) -> list[str]:
        raise NotImplementedError

    def add(self, d: Delta) -> list[str]:
        out = self.text(self.THINKING, d.reasoning) if d.reasoning else []
        if d.content:
            out += self.text(self.ANSWER, d.content)
        for call in d.calls:
            out += self.call(call)
        return out

    def text(self, kind: str, text: str) -> list[str]:
        raise NotImplementedError

    def call(self, call: CallDelta) -> list[str]:
        raise NotImplementedError

    def end(self, turn: Turn) -> tuple[list[str], dict[str, Any]]:
        """The last events, and the whole response."""
        raise NotImplementedError

    def error(self, e: ApiError) -> str:
        raise NotImplementedError


@dataclass(slots=True)
class Turn:
    fan: Fanout
    reply: Reply

    async def whole(self, request: Request) -> Parsed:
        """The output parsed whole, once it has ended (the client's disconnect aborts it), on a thread: a
        long output's parse and its thinking's count leave the event loop serving."""
        try:
            texts = await until_disconnect(request, self.fan.texts())
        finally:
            await self.fan.close()
        return await asyncio.to_thread(self.reply.whole, self.fan.choices[0].gen, texts[0])

    async def start(self, request: Request) -> None:
        """A stream's first tokens, before its headers: a refused request gets its HTTP status."""
        await begin(self.fan, request)

    async def deltas(self) -> AsyncIterator[Delta]:
        """What each piece adds, the last one's with the reply finished (`reply.reason`: the parser's end and
        the thinking's count, off the loop when the output is long, as the chat stream's finish chunk);
        leaving early, or an error raised here (ApiError), ends the request."""
        try:
            async for c, text in self.fan.results():
                if text is not None:
                    yield self.reply.feed(c.gen, text)
                else:
                    yield await self.fan.builder.build(lambda: self.reply.finish(c.gen), weight(c.gen.completion_tokens, 0))
        finally:
            await self.fan.close()

    def usage(self) -> Usage:
        return self.fan.usage()

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self.fan.choices[0].gen.stops.hit

    async def shown(self, view: View, request: Request) -> dict[str, Any]:
        """The whole response, once the output has ended."""
        await self.whole(request)
        view.add(self.reply.delta())
        return view.end(self)[1]

    async def events(self, view: View, done: Callable[[dict[str, Any]], None]) -> AsyncIterator[str]:
        """The response's events as the output streams (`start`ed); `done` gets the whole response at the end.
        An error ends the stream with the view's error event; a stream closed before its deltas began
        ends the request at once too (not when the garbage collector finalizes its pieces)."""
        try:
            for event in view.start():
                yield event
            async for delta in self.deltas():
                for event in view.add(delta):
                    yield event
        except ApiError as e:
            yield view.error(e)
            return
        finally:
            await self.fan.close()
        events, response = view.end(self)
        done(response)
        for event in events:
            yield event
