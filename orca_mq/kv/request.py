"""What the KV layer reads and writes of a request: the scheduler's Request (orca_mq/sched/request.py)
is one. Described here, below the scheduler, so that the KV layer names nothing above it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(slots=True)
class SwapCounts:
    """Its KV copies between the device and the host pool (FastServe's KV policies)."""
    offloads: int = 0
    uploads: int = 0
    offload_blocks: int = 0
    upload_blocks: int = 0


class KVRequest(Protocol):
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    n_prompt_fed: int          # prompt tokens fed so far: a cache hit feeds them without computing
    cached_tokens: int         # prompt tokens taken from the prefix cache
    reserved_blocks: int       # its reservation (ORCA's n_rsrv, FastServe's admission)
    kv_hashes: list[bytes]     # prefix hashes of its first full blocks (prefix.py)
    kv_published: int          # its leading blocks known computed
    swaps: SwapCounts

    @property
    def max_total_tokens(self) -> int:
        """What its reservation covers: its prompt and its max_tokens."""
        ...

    @property
    def prompt_pending(self) -> bool: ...

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether it may take its prompt's K/V from the prefix cache (not when every prompt
        position's logits are asked for: those are computed)."""
        ...
