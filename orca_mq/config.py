"""One typed config object, read from config.toml with `section.key=value` overrides."""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "config.toml"
API_KEY_ENV = "ORCA_MQ_API_KEY"    # server.api_key from the environment (a key on a command line is visible to `ps`)
MAX_API_KEY_CHARS = 256

# the config's choices, checked once when a value is set
DType = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
AttentionBackend = Literal["auto", "torch", "cpu", "triton"]
Gemm = Literal["auto", "torch", "onednn", "stream"]
Policy = Literal["orca", "request", "fastserve", "srpt"]
KVPolicy = Literal["proactive", "defer", "reactive"]
LogLevel = Literal["debug", "info", "warning", "error"]
JsonWhitespace = Literal["compact", "flexible"]
Switch = Literal["auto", "on", "off"]
SpecMethod = Literal["off", "ngram"]
Quantization = Literal["none", "fp8"]
Pooling = Literal["last", "mean"]   # an embedding's (orca_mq.protocol.pooling)
KVCacheDType = Literal["auto", "fp8"]
SplitKV = Literal["auto", "off"]
ToolCallParser = Literal["auto", "none", "hermes", "llama3_json", "mistral", "gpt_oss"]   # orca_mq.api.parsers' names
ReasoningParser = Literal["auto", "none", "think", "qwen3", "deepseek_r1", "gpt_oss"]


@dataclass(slots=True)
class ModelConfig:
    path: str = ""
    dtype: DType = "auto"
    max_model_len: int = 2048
    cache_dir: str = "~/.cache/orca_mq"
    max_logprobs: int = 20
    max_logit_bias: int = 1024
    quantization: Quantization = "none"
    pooling: Pooling = "last"


@dataclass(slots=True)
class EngineConfig:
    n_workers: int = 1
    tp_size: int = 1
    threads_per_worker: int = 2
    omp_spin_count: int = 3000
    malloc_top_pad: int = 64 << 20
    device: Device = "auto"
    attention_backend: AttentionBackend = "auto"
    gemm: Gemm = "auto"
    n_slots: int = 0
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: KVCacheDType = "auto"
    block_size: int = 16
    host_slots: int = 65536
    prefix_caching: bool = True
    deterministic: bool = False
    deterministic_rows: int = 16
    cuda_graphs: Switch = "auto"
    cuda_graph_max_bs: int = 0
    split_kv: SplitKV = "auto"


@dataclass(slots=True)
class SchedulerConfig:
    policy: Policy = "orca"
    max_bs: int = 32
    max_num_batched_tokens: int = 256
    async_scheduling: Switch = "auto"
    client_rows: int = -1


@dataclass(slots=True)
class SpeculativeConfig:
    method: SpecMethod = "off"
    num_tokens: int = 4
    lookup_min: int = 2
    lookup_max: int = 4
    max_batch_tokens: int = 32


@dataclass(slots=True)
class FastServeConfig:
    n_queues: int = 11
    quantum: float = 0.0
    quantum_ratio: float = 2.0
    starve_limit: float = 60.0
    length_window: int = 1000
    prior_jobs: float = 8.0
    preempt_margin: float = 2.0
    kv_policy: KVPolicy = "proactive"
    min_free_blocks: int = 8
    burst_queues: int = 2
    profile_max_len: int = 512


@dataclass(slots=True)
class ServerConfig:
    frontend_address: str = "tcp://127.0.0.1:5555"
    backend_address: str = ""
    worker_base_port: int = 0
    drain_timeout: float = 30.0
    ready_timeout: float = 300.0
    stop_grace: float = 10.0
    stats_timeout: float = 2.0
    max_restarts: int = 5
    restart_window: float = 300.0
    max_waiting: int = 1024
    max_frame_bytes: int = 64 << 20
    http_address: str = "127.0.0.1:8000"
    served_model_name: str = ""
    http_max_connections: int = 1024
    http_max_body_bytes: int = 4_194_304
    http_max_n: int = 16
    http_max_choices: int = 64
    http_max_logprobs: int = 262144
    http_max_embedding_inputs: int = 128
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    node_timeout: float = 10.0
    api_key: str = ""
    curve_secret_key: str = ""
    client_headroom: float = 0.0625
    tool_call_parser: ToolCallParser = "auto"
    reasoning_parser: ReasoningParser = "auto"
    responses_store: int = 1024

    def api_keys(self) -> tuple[str, ...]:
        """The accepted keys: `api_key` split at commas; none = no authentication."""
        return tuple(k for k in self.api_key.split(",") if k)

    def served_names(self) -> tuple[str, ...]:
        """The names the HTTP API serves the model as (`served_model_name` split at commas); none = its file's name."""
        return tuple(n for n in (n.strip() for n in self.served_model_name.split(",")) if n)


@dataclass(slots=True)
class StructuredConfig:
    max_spec_bytes: int = 65536
    compile_timeout: float = 10.0
    cache_size: int = 256
    json_whitespace: JsonWhitespace = "compact"
    mask_threads: int = 0
    max_number_digits: int = 16
    close_margin: int = 4
    close_guard: int = 32
    plan_budget: int = 4096


@dataclass(slots=True)
class LogConfig:
    dir: str = "logs/{port}"
    level: LogLevel = "info"
    stderr: bool = False
    progress: bool = True


@dataclass(slots=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    fastserve: FastServeConfig = field(default_factory=FastServeConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    structured: StructuredConfig = field(default_factory=StructuredConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def set(self, dotted: str, value: Any) -> None:
        """Set `section.key` (or a bare key when it is unique across sections), coercing strings."""
        section, key = self._locate(dotted)
        sub = getattr(self, section)
        setattr(sub, key, _coerce(value, _HINTS[section][key], dotted))

    def _locate(self, dotted: str) -> tuple[str, str]:
        if "." in dotted:
            section, key = dotted.split(".", 1)
            if section not in _SECTIONS or key not in _fields(_SECTIONS[section]):
                raise KeyError(f"unknown config key {dotted!r}{_did_you_mean(dotted)}")
            return section, key
        owners = [s for s, cls in _SECTIONS.items() if dotted in _fields(cls)]
        if len(owners) != 1:
            raise KeyError(f"unknown or ambiguous config key {dotted!r}{_did_you_mean(dotted)}")
        return owners[0], dotted

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, Any]]) -> "Config":
        cfg = cls()
        for section, values in data.items():
            if section not in _SECTIONS:
                close = difflib.get_close_matches(section, _SECTIONS, n=1)
                raise KeyError(f"unknown config section [{section}]" + (f" (did you mean [{close[0]}]?)" if close else ""))
            for key, value in values.items():
                cfg.set(f"{section}.{key}", value)
        return cfg


_SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


_HINTS: dict[str, dict[str, Any]] = {name: get_type_hints(cls) for name, cls in _SECTIONS.items()}


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _did_you_mean(dotted: str) -> str:
    """' (did you mean KEY?)': the keys of that name in other sections (engine.max_bs -> scheduler.max_bs),
    else the closest spelling (scheduler.maxbs -> scheduler.max_bs); '' when nothing is close."""
    keys = [f"{s}.{k}" for s, cls in _SECTIONS.items() for k in sorted(_fields(cls))]
    name = dotted.rsplit(".", 1)[-1]
    close = [k for k in keys if k.endswith(f".{name}")] or difflib.get_close_matches(
        dotted, keys if "." in dotted else [k.split(".", 1)[1] for k in keys], n=1)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def _coerce(value: Any, kind: Any, name: str) -> Any:
    if get_origin(kind) is Literal:
        if value not in get_args(kind):
            raise ValueError(f"{name}: expected one of {' | '.join(get_args(kind))}, got {value!r}")
        return value
    if isinstance(value, str) and kind is not str:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{name}: expected a boolean, got {value!r}")
            return value.lower() in ("true", "1")
        try:
            return kind(value)
        except ValueError as e:
            raise ValueError(f"{name}: expected {kind.__name__}, got {value!r}") from e
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{name}: expected {kind.__name__}, got {value!r}")
    return value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | list[str] | None = None,
                expand_log_dir: bool = True) -> Config:
    """Read config.toml (default: the repo's), take server.api_key from $ORCA_MQ_API_KEY when set, apply
    overrides ({"a.b": v} or ["a.b=v", ...]), and check what is checked once for the whole config."""
    path = Path(path or DEFAULT_CONFIG_PATH)
    with open(path, "rb") as f:
        cfg = Config.from_dict(tomllib.load(f))
    if API_KEY_ENV in os.environ:
        cfg.server.api_key = os.environ[API_KEY_ENV]
    if cfg.log.dir:  # the config's own directory, wherever the server is started from
        cfg.log.dir = str((path.resolve().parent / cfg.log.dir).resolve())
    if isinstance(overrides, list):
        pairs = []
        for item in overrides:
            if "=" not in item:
                raise ValueError(f"override {item!r} is not section.key=value")
            pairs.append(item.split("=", 1))
        overrides = dict(pairs)
    for key, value in (overrides or {}).items():
        cfg.set(key, value)
        if key in ("log.dir", "dir") and cfg.log.dir:  # a path the user gives: relative to where they are
            cfg.log.dir = str(Path(cfg.log.dir).resolve())
    check(cfg)
    if expand_log_dir:
        cfg.log.dir = cfg.log.dir.replace("{port}", server_name(cfg.server.frontend_address))
    return cfg


@dataclass(frozen=True, slots=True)
class Range:
    """A numeric knob's allowed values: low <= v (low < v when `above`), v <= high when high is set; finite."""

    low: float
    high: float | None = None
    above: bool = False
    note: str = ""      # what the edge value means, said with the error

    def __contains__(self, v: float) -> bool:
        return math.isfinite(v) and (v > self.low if self.above else v >= self.low) and (self.high is None or v <= self.high)

    def __str__(self) -> str:
        text = (f"in [{self.low:g}, {self.high:g}]" if self.high is not None
                else f"{'>' if self.above else '>='} {self.low:g}")
        return text + (f" ({self.note})" if self.note else "")


_POSITIVE = Range(0, above=True)
_COUNT = Range(0)
_ONE = Range(1)
MAX_PROMPTS = 4096   # the most prompts (embedding inputs) an HTTP body's list may hold: its schema stops reading there
# every int and float knob's range, checked once when a config is loaded (tests hold it complete)
RANGES: dict[str, Range] = {
    "model.max_model_len": _ONE, "model.max_logprobs": Range(0, 1 << 20),
    "model.max_logit_bias": Range(0, 4096, note="protocol.sampling.MAX_LOGIT_BIAS_ENTRIES"),
    "engine.n_workers": _ONE, "engine.tp_size": _ONE, "engine.threads_per_worker": _ONE,
    "engine.omp_spin_count": Range(-1, note="-1: the environment's"),
    "engine.malloc_top_pad": Range(-1, note="-1: the environment's"), "engine.n_slots": Range(0, note="0: sized at start"),
    "engine.gpu_memory_utilization": Range(0, 1, above=True), "engine.block_size": _ONE, "engine.host_slots": _COUNT, "engine.deterministic_rows": _ONE,
    "engine.cuda_graph_max_bs": Range(0, note="0: scheduler.max_bs"),
    "scheduler.max_bs": _ONE, "scheduler.max_num_batched_tokens": Range(0, note="0: whole prompts"),
    "scheduler.client_rows": Range(-1, note="-1: 2 on a CPU, none on CUDA; 0: no cap"),
    "speculative.num_tokens": Range(1, 64), "speculative.lookup_min": _ONE, "speculative.lookup_max": Range(1, 64),
    "speculative.max_batch_tokens": _ONE,
    "fastserve.n_queues": _ONE, "fastserve.quantum": Range(0, note="0: one profiled iteration"),
    "fastserve.quantum_ratio": _ONE, "fastserve.starve_limit": _POSITIVE, "fastserve.length_window": _COUNT,
    "fastserve.prior_jobs": _POSITIVE, "fastserve.preempt_margin": _COUNT, "fastserve.min_free_blocks": _COUNT,
    "fastserve.burst_queues": _COUNT, "fastserve.profile_max_len": _ONE,
    "server.worker_base_port": Range(0, 65535, note="0: a free port"), "server.drain_timeout": _COUNT,
    "server.ready_timeout": _POSITIVE, "server.stop_grace": _COUNT, "server.stats_timeout": _POSITIVE,
    "server.max_restarts": _COUNT, "server.restart_window": _POSITIVE, "server.max_waiting": _COUNT,
    "server.max_frame_bytes": _ONE, "server.http_max_connections": _ONE, "server.http_max_body_bytes": _ONE,
    "server.http_max_n": _ONE, "server.http_max_choices": Range(1, MAX_PROMPTS), "server.http_max_logprobs": _ONE,
    "server.responses_store": Range(0, note="0: none stored"), "server.http_max_embedding_inputs": Range(1, MAX_PROMPTS),
    "server.nnodes": _ONE, "server.node_rank": _COUNT, "server.node_timeout": _POSITIVE,
    "server.client_headroom": Range(0, 0.5, note="0: no fair shares"),
    "structured.max_spec_bytes": _ONE, "structured.compile_timeout": _POSITIVE, "structured.cache_size": _COUNT,
    "structured.mask_threads": Range(0, note="0: llguidance's default"),
    "structured.max_number_digits": Range(0, 1024, note="0: unbounded"), "structured.close_margin": _COUNT,
    "structured.close_guard": _COUNT, "structured.plan_budget": Range(0, note="0: unbounded"),
}


def numeric_keys() -> list[str]:
    """Every `section.key` whose value is an int or a float."""
    return [f"{s}.{k}" for s, hints in _HINTS.items() for k, kind in hints.items() if kind in (int, float)]


def check(cfg: Config) -> None:
    """Checks across keys or inside a string, once per load: a mistake is a one-line ValueError."""
    for dotted in numeric_keys():
        section, key = dotted.split(".")
        value, allowed = getattr(getattr(cfg, section), key), RANGES.get(dotted)
        if allowed is not None and value not in allowed:
            raise ValueError(f"{dotted} must be {allowed}, got {value!r}")
    if cfg.server.node_rank >= cfg.server.nnodes:
        raise ValueError(f"server.node_rank must be below server.nnodes ({cfg.server.nnodes}), got {cfg.server.node_rank}")
    for name in cfg.server.served_names():
        if len(name) > 256 or not name.isprintable():
            raise ValueError(f"server.served_model_name: each name (comma-separated) must be 1 to 256 printable "
                             f"characters, got {name[:80]!r}")
    if "gpt_oss" in (cfg.server.tool_call_parser, cfg.server.reasoning_parser) and {
            cfg.server.tool_call_parser, cfg.server.reasoning_parser} - {"gpt_oss", "auto", "none"}:
        raise ValueError("server.tool_call_parser and server.reasoning_parser: gpt_oss reads both the reasoning and the "
                         "tool calls (harmony's channels), so it pairs with itself, auto or none")
    if cfg.speculative.lookup_min > cfg.speculative.lookup_max:
        raise ValueError(f"speculative.lookup_min ({cfg.speculative.lookup_min}) must not exceed speculative.lookup_max "
                         f"({cfg.speculative.lookup_max})")
    if cfg.scheduler.async_scheduling == "on" and cfg.engine.n_workers * cfg.engine.tp_size != 1:
        raise ValueError("scheduler.async_scheduling = on needs one worker (engine.n_workers = engine.tp_size = 1): "
                         "the next iteration's tokens are read where the last one sampled them")
    for key in cfg.server.api_keys():
        if len(key) > MAX_API_KEY_CHARS or not re.fullmatch(r"[!-~]+", key):
            raise ValueError(f"server.api_key: each key (comma-separated) must be 1 to {MAX_API_KEY_CHARS} "
                             "printable ASCII characters without spaces")
    for name in ("frontend_address", "backend_address"):
        address = getattr(cfg.server, name)
        if address.startswith("tcp://"):
            host_port(address[len("tcp://"):], f"server.{name}")
    if cfg.server.http_address:
        host_port(cfg.server.http_address, "server.http_address")


def host_port(address: str, what: str) -> tuple[str, int]:
    """`host:port` -> (host, port), the port in 1-65535."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{what}: expected host:port with a port in 1-65535, got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def server_name(frontend_address: str) -> str:
    """A server's name in paths (its log dir): the client port of a tcp:// address, else the address made safe."""
    if frontend_address.startswith("tcp://"):
        return frontend_address.rpartition(":")[2]
    return re.sub(r"[^A-Za-z0-9._-]+", "_", frontend_address).strip("_") or "server"
