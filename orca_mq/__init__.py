"""orca-mq: ORCA iteration-level scheduling and selective batching, FastServe skip-join MLFQ."""
from orca_mq.llm import LLM, RequestOutput
from orca_mq.sampling_params import InvalidRequest, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "InvalidRequest"]
