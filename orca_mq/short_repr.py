"""Quoting a rejected value in an error message without copying megabytes of someone else's input."""
from __future__ import annotations

from typing import Any


def short_repr(value: Any, limit: int = 80) -> str:
    """repr of a rejected value, cut: it may be megabytes of someone else's frame."""
    if isinstance(value, (list, tuple, dict, str, bytes)) and len(value) > limit:
        return f"<{type(value).__name__} of {len(value)}>"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
