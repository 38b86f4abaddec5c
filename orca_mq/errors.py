"""The error a request that cannot be served as given raises (its own module: sampling params and
structured outputs both raise it, and sampling params hold structured outputs)."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """A request that cannot be served as given; the message names the problem."""
