"""A request of the Responses or Messages API as the chat request it stands for: one choice, run by the
chat path (orca_mq.api.fanout) and read by the model's parsers (orca_mq.api.reply), whole or as the
deltas its view turns into its own events. The views differ only in how they show a Delta, a Parsed
output and the usage: the request, the engine and the parsing are the chat API's."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request

from orca_mq.api.fanout import Fanout, begin
from orca_mq.api.parsers import Delta, Parsed
from orca_mq.api.reply import Reply
from orca_mq.api.schemas import Usage
from orca_mq.api.stream import until_disconnect


@dataclass(slots=True)
class Turn:
    fan: Fanout
    reply: Reply

    async def whole(self, request: Request) -> Parsed:
        """The output parsed whole, once it has ended (the client's disconnect aborts it)."""
        try:
            texts = await until_disconnect(request, self.fan.texts())
        finally:
            await self.fan.close()
        return self.reply.whole(self.fan.choices[0].gen, texts[0])

    async def start(self, request: Request) -> None:
        """A stream's first tokens, before its headers: a refused request gets its HTTP status."""
        await begin(self.fan, request)

    async def deltas(self) -> AsyncIterator[Delta]:
        """What each piece adds, the last one's with the reply finished (`reply.reason`); leaving early, or
        an error raised here (ApiError), ends the request."""
        try:
            async for c, text in self.fan.results():
                yield self.reply.feed(c.gen, text) if text is not None else self.reply.finish(c.gen)
        finally:
            await self.fan.close()

    def usage(self) -> Usage:
        return self.fan.usage()
