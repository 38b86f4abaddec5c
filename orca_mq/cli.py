"""The `orca-mq` command: serve, client, logs, keys, bench. Imports nothing heavy until a command runs.

    orca-mq serve [--model PATH] [--port N] [--host H] [--http-port N] [--served-model-name NAME ...] [--api-key KEY]
                  [--tool-call-parser NAME] [--reasoning-parser NAME] [--config FILE] [--set section.key=value ...]
    orca-mq client --prompt "Hello" [--port N | --address ADDR] [--api-key KEY] [--chat] [--max-tokens N] ...
    orca-mq logs [--port N] [-f] [-n N] [--json]
    orca-mq keys DIR             (a CurveZMQ key pair for server.curve_secret_key)
    orca-mq bench ...            (tools/bench.py, from a source checkout)

Every mistake is one line on stderr and exit status 1 (2 for a bad command line); details go to the logs.
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import socket
import sys
import tomllib
from pathlib import Path
from typing import Any, NoReturn

from orca_mq import __version__
from orca_mq.config import API_KEY_ENV, DEFAULT_CONFIG_PATH, Config, host_port, load_config
from orca_mq.protocol.common_msgs import UNAUTHORIZED

COMMANDS = ("serve", "client", "logs", "keys", "bench")
NODE_FLAGS = {"--nnodes": "server.nnodes", "--node-rank": "server.node_rank",
              "--master-addr": "server.master_addr", "--master-port": "server.worker_base_port"}
PARSER_FLAGS = {"--tool-call-parser": "server.tool_call_parser", "--reasoning-parser": "server.reasoning_parser"}   # vLLM's flags


class _Parser(argparse.ArgumentParser):
    """A command-line mistake is one line (and exit status 2), not the usage block; a mistyped option
    names the closest one of its command (argparse would first ask for a required option it hides)."""

    commands: dict[str, argparse.ArgumentParser] = {}

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        args = sys.argv[1:] if args is None else list(args)
        command = self.commands.get(next((a for a in args if not a.startswith("-")), ""))
        options = [o for p in (self, command) if p is not None for o in p._option_string_actions]
        for arg in args[:args.index("--") if "--" in args else len(args)]:
            flag = arg.split("=", 1)[0]
            if flag.startswith("--") and " " not in arg and not any(o.startswith(flag) for o in options):
                close = difflib.get_close_matches(flag, options, n=1)
                if close:   # no match: argparse says what it says
                    (command or self).error(f"unrecognized argument {flag}: did you mean {close[0]}?")
        return super().parse_args(args, namespace)


def _sections() -> str:
    return "config sections (each key: orca-mq serve --set section.key=value; defaults in config.toml):\n" + "\n".join(
        f"  [{name}] " + ", ".join(sub) for name, sub in Config().to_dict().items())


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 1-65535, got {text!r}")
    return int(text)


def _model_name(text: str) -> str:
    if not text or "," in text:
        raise argparse.ArgumentTypeError(f"a model name is non-empty, without commas: got {text!r}")
    return text


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help=f"config file (default: {DEFAULT_CONFIG_PATH})")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = _Parser(prog="orca-mq", description=__doc__, epilog=_sections(), formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"orca-mq {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}", parser_class=_Parser)
    p.commands = sub.choices
    serve = sub.add_parser("serve", help="start a server (every process) and supervise it", epilog=_sections(), formatter_class=fmt)
    _config_args(serve)
    serve.add_argument("--model", help="GGUF file or Hugging Face directory (model.path)")
    serve.add_argument("--port", type=_port, help="ZeroMQ client port on 127.0.0.1 (server.frontend_address)")
    serve.add_argument("--http-port", type=_port, help="OpenAI-compatible HTTP port, on --host (server.http_address)")
    serve.add_argument("--host", help="the HTTP API's host: 0.0.0.0 = every interface (server.http_address; default 127.0.0.1)")
    serve.add_argument("--served-model-name", nargs="+", metavar="NAME", type=_model_name,
                       help="the model's names on the HTTP API, the first listed first (server.served_model_name; "
                            "default: the model file's name)")
    serve.add_argument("--api-key", help=f"API key(s), comma-separated (server.api_key; ${API_KEY_ENV} keeps it off the command line)")
    for flag, key in (NODE_FLAGS | PARSER_FLAGS).items():  # torchrun's and vLLM's shorthands of [server] keys
        serve.add_argument(flag, dest=key, default=None, metavar=flag[2:].upper(), help=f"= --set {key}=...")
    client = sub.add_parser("client", help="send one request and stream the text")
    client.add_argument("--prompt", required=True)
    client.add_argument("--chat", action="store_true", help="treat the prompt as a user message (chat template)")
    client.add_argument("--max-tokens", type=int, default=64)
    client.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the server's, 1.0)")
    client.add_argument("--top-p", type=float, default=None)
    client.add_argument("--top-k", type=int, default=None)
    client.add_argument("--seed", type=int, default=None)
    client.add_argument("--ignore-eos", action="store_true")
    client.add_argument("--structured-outputs", type=json.loads, default=None, metavar="JSON",
                        help='constrain the output: \'{"regex": "[0-9]+"}\', \'{"choice": ["yes", "no"]}\', \'{"json": SCHEMA}\'')
    client.add_argument("--json", action="store_true", help="print one final JSON line instead of streaming")
    where = client.add_mutually_exclusive_group()
    where.add_argument("--address", default=None, help="server address (default: tcp://127.0.0.1:5555)")
    where.add_argument("--port", type=_port, default=None, help="= --address tcp://127.0.0.1:PORT (the server's --port)")
    client.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), help=f"the server's API key (default: ${API_KEY_ENV})")
    client.add_argument("--server-key", default=None, help="the server's CurveZMQ public key file (or Z85 text): encrypt")
    logs = sub.add_parser("logs", help="merged structured logs of one server's processes")
    _config_args(logs)
    logs.add_argument("--port", type=_port, help="the server's client port (default: the only running server)")
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    logs.add_argument("-n", "--lines", type=int, default=200, help="last N lines (0 = all)")
    logs.add_argument("--json", action="store_true", help="print the raw JSON lines")
    keys = sub.add_parser("keys", help="make a CurveZMQ key pair (server.curve_secret_key, and the public key for clients)")
    keys.add_argument("dir", help="directory to write server.key (public) and server.key_secret (secret, mode 600) into")
    sub.add_parser("bench", help="replay a trace against a server (tools/bench.py; see orca-mq bench --help)", add_help=False)
    return p


def _config(args: argparse.Namespace, expand_log_dir: bool = True) -> Config:
    sets = list(args.set)
    if getattr(args, "model", None):
        given = Path(args.model).expanduser()   # as given when missing: the error can tell a hub id
        sets.append(f"model.path={given.resolve() if given.exists() else args.model}")
    if getattr(args, "port", None):
        sets.append(f"server.frontend_address=tcp://127.0.0.1:{args.port}")
    if getattr(args, "served_model_name", None):
        sets.append(f"server.served_model_name={','.join(args.served_model_name)}")
    if getattr(args, "api_key", None) is not None:
        sets.append(f"server.api_key={args.api_key}")
    sets += [f"{key}={v}" for key in (NODE_FLAGS | PARSER_FLAGS).values() if (v := getattr(args, key, None)) is not None]
    try:
        host, http_port = getattr(args, "host", None), getattr(args, "http_port", None)
        if host is not None and http_port is None:  # the configured port on another host
            configured = load_config(args.config, sets, expand_log_dir).server.http_address
            if not configured:
                raise SystemExit("orca-mq: --host needs the HTTP API, which server.http_address turns off: give --http-port too")
            http_port = host_port(configured, "server.http_address")[1]
        if http_port is not None:
            host = host or "127.0.0.1"
            sets.append(f"server.http_address={f'[{host}]' if ':' in host else host}:{http_port}")
        return load_config(args.config, sets, expand_log_dir)
    except (KeyError, ValueError, OSError, tomllib.TOMLDecodeError) as e:
        raise SystemExit(f"orca-mq: config: {e.args[0] if isinstance(e, KeyError) else e}") from None


def _check_free(host: str, port: int, address: str, flag: str) -> None:
    """A busy port is one line naming the flag that moves it, not a broker traceback."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0" if host == "*" else host, port))
        except (OSError, OverflowError) as e:
            why = getattr(e, "strerror", None) or str(e)
            raise SystemExit(f"orca-mq: cannot listen on {address}: {why} (another server? choose another port with {flag})") from None


def _preflight(cfg: Config) -> None:
    """What would otherwise fail inside a child a minute later: one line now, the details in the logs."""
    from orca_mq.auth import server_keys
    from orca_mq.models.registry import read_model_info

    if cfg.server.node_rank == 0:
        front = cfg.server.frontend_address
        if front.startswith("tcp://"):
            _check_free(*host_port(front[len("tcp://"):], "server.frontend_address"), front, "--port")
        if cfg.server.http_address:
            _check_free(*host_port(cfg.server.http_address, "server.http_address"), cfg.server.http_address, "--http-port")
    from orca_mq.models.checked import check_checkpoint
    from orca_mq.runtime.device import check_fp8
    from orca_mq.server.nodes import check_gpus

    steps = [("workers", lambda: check_gpus(cfg)), ("fp8", lambda: check_fp8(cfg)),
             ("model", lambda: check_checkpoint(read_model_info(cfg.model.path, cfg.model.cache_dir), cfg.model.cache_dir))]
    if cfg.server.curve_secret_key:
        steps.append(("server.curve_secret_key", lambda: server_keys(cfg.server.curve_secret_key)))
    for what, step in steps:
        try:
            step()
        except Exception as e:
            from orca_mq.logs import setup_logging
            from orca_mq.server.process import one_line

            setup_logging("launcher", cfg.log).exception("start-up check failed", what=what)
            raise SystemExit(f"orca-mq: {what}: {one_line(e)}" + (f" (details in {cfg.log.dir})" if cfg.log.dir else "")) from None


def _serve(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if cfg.server.nnodes > 1 and not cfg.server.worker_base_port:
        raise SystemExit("orca-mq: --master-port (server.worker_base_port) is required with --nnodes > 1")
    _preflight(cfg)
    from orca_mq.server.launcher import Launcher
    from orca_mq.server.node_launcher import NodeLauncher
    from orca_mq.server.process import exit_now

    launcher = Launcher(cfg) if cfg.server.node_rank == 0 else NodeLauncher(cfg)
    try:
        code = launcher.run()
    except Exception as e:  # a launcher bug or an unexpected OS error: one line, the traceback in the log
        from orca_mq.server.process import one_line

        launcher.log.exception("launcher failed")
        raise SystemExit(f"orca-mq: {one_line(e)} (details in {cfg.log.dir})") from None
    exit_now(code)   # every child is stopped, the logs written


def _client(args: argparse.Namespace) -> int:
    from orca_mq.client import DEFAULT_ADDRESS, Client

    sampling: dict[str, Any] = {"max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos}
    for key in ("temperature", "top_p", "top_k", "seed", "structured_outputs"):
        if getattr(args, key) is not None:
            sampling[key] = getattr(args, key)
    address = args.address or (f"tcp://127.0.0.1:{args.port}" if args.port else DEFAULT_ADDRESS)
    try:
        client = Client(address, api_key=args.api_key, server_key=args.server_key)
    except ValueError as e:
        raise SystemExit(f"orca-mq: {e}") from None
    with client:
        if args.json:
            out = client.generate(args.prompt, chat=args.chat, **sampling)
            error = _said(out.code, out.error, args.api_key)
            print(json.dumps({"request_id": out.request_id, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason} | ({"error": error, "code": out.code} if error else {})))
            return 1 if out.finish_reason == "error" else 0
        for ev in client.stream(args.prompt, chat=args.chat, **sampling):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            if ev.finished:
                sys.stdout.write("\n")
                if ev.error:
                    print(f"error ({ev.code}): {_said(ev.code, ev.error, args.api_key)}", file=sys.stderr)
                    return 1
    return 0


def _said(code: str | None, error: str | None, api_key: str | None) -> str | None:
    """A final's error as the command line puts it: an unauthorized one names --api-key (the server's
    sentence names the Python client's api_key=)."""
    if code != UNAUTHORIZED:
        return error
    if not api_key:
        return f"unauthorized: this server needs an API key: give it with --api-key KEY (or ${API_KEY_ENV})"
    return f"unauthorized: the server does not take this API key (--api-key or ${API_KEY_ENV})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        bench = Path(__file__).resolve().parents[1] / "tools" / "bench.py"
        if not bench.exists():
            raise SystemExit("orca-mq bench needs a source checkout (tools/bench.py)")
        os.execv(sys.executable, [sys.executable, str(bench), *argv[1:]])
    args = build_parser().parse_args(argv)
    if args.command in ("serve", "client"):
        try:
            return _serve(args) if args.command == "serve" else _client(args)
        except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for it (the launcher drains by itself)
            print(f"\norca-mq {args.command}: interrupted", file=sys.stderr)
            return 130
    if args.command == "logs":
        from orca_mq.logs import choose_log_dir, show_logs

        log_dir = _config(args).log.dir if args.port else str(choose_log_dir(_config(args, expand_log_dir=False).log.dir))
        try:
            show_logs(log_dir, args.follow, args.lines, args.json)
        except KeyboardInterrupt:
            pass
        return 0
    if args.command == "keys":
        from orca_mq.auth import create_keys

        try:
            public, secret = create_keys(args.dir)
        except OSError as e:
            raise SystemExit(f"orca-mq keys: {e}") from None
        print(f"public key (give it to clients: server_key=, --server-key): {public}\n"
              f"secret key (keep it: --set server.curve_secret_key={secret}): {secret}")
        return 0
    build_parser().print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
