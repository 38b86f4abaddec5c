"""POST /tokenize and POST /detokenize, in vLLM's shapes:

    /tokenize   {model?, prompt | messages, add_special_tokens?, chat_template_kwargs?} -> {tokens, count, max_model_len}
    /detokenize {model?, tokens}                                 -> {prompt}

The API process tokenizes these itself (generation requests it leaves to the frontend), through the
frontend's own path (orca_mq.admission.prompts.Prompts: `check`, then `token_ids`): the same chat
template, the same special tokens, so `count` is the `usage.prompt_tokens` a completion of that
prompt reports. A prompt that cannot fit the context is refused by its length in characters before
anything reads it; the tokenizer runs on a thread (the Rust tokenizer without the GIL), so a long
prompt leaves the event loop serving. The tokenizer is loaded on the first call (from its entry under
`model.cache_dir`, a fraction of a second; the first process to need it makes it: seconds), not at start.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field, model_validator
from pydantic_core import PydanticCustomError

from orca_mq.api.errors import ApiError
from orca_mq.api.fields import bounded
from orca_mq.api.schemas import MAX_MESSAGES, ChatMessage, Strict, TokenId
from orca_mq.config import Config
from orca_mq.errors import InvalidRequest
from orca_mq.protocol.client_msgs import Generate
from orca_mq.protocol.common_msgs import INVALID_REQUEST

if TYPE_CHECKING:
    from orca_mq.admission.prompts import Prompts

THREADS = 2   # a long prompt's tokenization leaves a thread for short ones


class TokenizeRequest(Strict):
    UNSUPPORTED = {"add_generation_prompt": (True,), "continue_final_message": (False,), "return_token_strs": (False,)}

    model: str | None = None
    prompt: str | None = None
    messages: bounded(list[ChatMessage], MAX_MESSAGES, least=1) | None = None
    # whether the tokenizer adds its special tokens (BOS): default yes for a prompt, no for messages (the
    # chat template writes them), as vLLM and as a generation of the same prompt
    add_special_tokens: bool | None = Field(None, strict=True)
    chat_template_kwargs: dict[str, Any] | None = None   # with messages, as a chat completion's (checked by Prompts.check)

    @model_validator(mode="after")
    def _one_prompt(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("value_error", "give prompt or messages (one of them)", {"param": "prompt"})
        return self

    def message(self) -> Generate:
        """As the frontend receives the same prompt (a completion's text, or a chat's messages)."""
        if self.messages is not None:
            return Generate("tokenize", messages=[m.plain() for m in self.messages],
                            chat_template_kwargs=self.chat_template_kwargs)
        return Generate("tokenize", prompt=self.prompt, chat_template_kwargs=self.chat_template_kwargs)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class Tokenization:
    """The API process's tokenizer, loaded on first use, run on its own threads."""

    def __init__(self, cfg: Config, max_model_len: int, vocab_size: int) -> None:
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.pool = ThreadPoolExecutor(THREADS, thread_name_prefix="tokenize")
        self._prompts: Prompts | None = None
        self._loading = asyncio.Lock()

    async def prompts(self) -> Prompts:
        async with self._loading:
            if self._prompts is None:
                self._prompts = await asyncio.get_running_loop().run_in_executor(self.pool, self._load)
        return self._prompts

    def _load(self) -> Prompts:
        from orca_mq.admission.prompts import Prompts
        from orca_mq.tokenizer import load_tokenizer

        return Prompts.for_model(load_tokenizer(self.cfg.model.path, self.cfg.model.cache_dir), self.max_model_len)

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        prompts = await self.prompts()
        msg = body.message()
        ids = await self._run(prompts.check, msg, prompts.token_ids, msg, body.add_special_tokens)
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids)

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        prompts = await self.prompts()

        def check(ids: list[int]) -> None:
            if len(ids) > self.max_model_len:
                raise InvalidRequest(f"{len(ids)} tokens; the context length is {self.max_model_len}")
            if bad := [t for t in ids if t >= self.vocab_size][:5]:
                raise InvalidRequest(f"token ids outside the vocabulary [0, {self.vocab_size}): {bad}")

        return DetokenizeResponse(prompt=await self._run(check, body.tokens, prompts.decode, body.tokens))

    async def _run(self, check: Any, arg: Any, work: Any, *args: Any) -> Any:
        """`check(arg)` here (cheap: the size bound), then `work(*args)` on a thread; InvalidRequest -> 400."""
        try:
            check(arg)
            return await asyncio.get_running_loop().run_in_executor(self.pool, work, *args)
        except InvalidRequest as e:
            raise ApiError(400, str(e), INVALID_REQUEST) from None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
