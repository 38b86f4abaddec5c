"""orca-mq: ORCA iteration-level scheduling and selective batching, FastServe skip-join MLFQ.

The offline API (`LLM`) loads torch; it is imported on first use, so that the client
(`orca_mq.client`) and the command line answer without it.
"""
from __future__ import annotations

from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("orca-mq")
except PackageNotFoundError:  # a source checkout that was never installed
    __version__ = "0+unknown"

if TYPE_CHECKING:
    from orca_mq.llm import LLM
    from orca_mq.outputs import RequestOutput
    from orca_mq.errors import InvalidRequest
    from orca_mq.protocol.sampling import SamplingParams
    from orca_mq.protocol.structured import StructuredOutputsParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutputsParams", "InvalidRequest", "__version__"]
_LAZY = {"LLM": "orca_mq.llm", "RequestOutput": "orca_mq.outputs", "SamplingParams": "orca_mq.protocol.sampling",
         "StructuredOutputsParams": "orca_mq.protocol.structured", "InvalidRequest": "orca_mq.errors"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'orca_mq' has no attribute {name!r}")
