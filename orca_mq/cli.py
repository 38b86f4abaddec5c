"""The `orca-mq` command: serve, client, logs, bench. Imports nothing heavy until a command runs.

    orca-mq serve [--model PATH] [--port N] [--config FILE] [--set section.key=value ...]
    orca-mq client --prompt "Hello" [--chat] [--max-tokens N] [--temperature T] ...
    orca-mq logs [-f] [-n N] [--json]
    orca-mq bench ...            (tools/bench.py, from a source checkout)
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tomllib
from pathlib import Path
from typing import Any

from orca_mq import __version__
from orca_mq.config import DEFAULT_CONFIG_PATH, Config, load_config

COMMANDS = ("serve", "client", "logs", "bench")
NODE_FLAGS = {"--nnodes": "server.nnodes", "--node-rank": "server.node_rank",
              "--master-addr": "server.master_addr", "--master-port": "server.worker_base_port"}


def _sections() -> str:
    return "config sections (each key: orca-mq serve --set section.key=value; defaults in config.toml):\n" + "\n".join(
        f"  [{name}] " + ", ".join(sub) for name, sub in Config().to_dict().items())


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help=f"config file (default: {DEFAULT_CONFIG_PATH})")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="override a config key (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="orca-mq", description=__doc__, epilog=_sections(), formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"orca-mq {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    serve = sub.add_parser("serve", help="start a server (every process) and supervise it", epilog=_sections(), formatter_class=fmt)
    _config_args(serve)
    serve.add_argument("--model", help="GGUF file or Hugging Face directory (model.path)")
    serve.add_argument("--port", type=int, help="client port on 127.0.0.1 (server.frontend_address)")
    for flag, key in NODE_FLAGS.items():  # torchrun-style shorthands of [server] keys, for many hosts
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
    client.add_argument("--address", default=None, help="server address (default: tcp://127.0.0.1:5555)")
    logs = sub.add_parser("logs", help="merged structured logs of every process")
    _config_args(logs)
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    logs.add_argument("-n", "--lines", type=int, default=200, help="last N lines (0 = all)")
    logs.add_argument("--json", action="store_true", help="print the raw JSON lines")
    sub.add_parser("bench", help="replay a trace against a server (tools/bench.py; see orca-mq bench --help)", add_help=False)
    return p


def _config(args: argparse.Namespace) -> Config:
    sets = list(args.set)
    if getattr(args, "model", None):
        sets.append(f"model.path={Path(args.model).expanduser().resolve()}")
    if getattr(args, "port", None):
        sets.append(f"server.frontend_address=tcp://127.0.0.1:{args.port}")
    sets += [f"{key}={v}" for key in NODE_FLAGS.values() if (v := getattr(args, key, None)) is not None]
    try:
        return load_config(args.config, sets)
    except (KeyError, ValueError, OSError, tomllib.TOMLDecodeError) as e:
        raise SystemExit(f"orca-mq: config: {e.args[0] if isinstance(e, KeyError) else e}") from None


def _check_free(address: str) -> None:
    """A busy port is one line, not a broker traceback."""
    if not address.startswith("tcp://"):
        return
    host, _, port = address[len("tcp://"):].rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]") if host != "*" else "0.0.0.0", int(port)))
        except (OSError, ValueError) as e:
            raise SystemExit(f"orca-mq: cannot listen on {address}: {e.strerror or e} (another server? choose --port)") from None


def _serve(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if cfg.server.nnodes > 1 and not cfg.server.worker_base_port:
        raise SystemExit("orca-mq: --master-port (server.worker_base_port) is required with --nnodes > 1")
    if cfg.server.node_rank == 0:
        _check_free(cfg.server.frontend_address)
        if cfg.server.http_address:
            _check_free(f"tcp://{cfg.server.http_address}")
    if not cfg.model.path:
        from orca_mq.engine.model_files import embedded_model_path
        try:
            embedded_model_path()
        except FileNotFoundError as e:
            raise SystemExit(f"orca-mq: {e}") from None
    elif not Path(cfg.model.path).exists():
        raise SystemExit(f"orca-mq: model.path does not exist: {cfg.model.path}")
    if cfg.server.node_rank == 0:
        from orca_mq.server.launcher import Launcher

        return Launcher(cfg).run()
    from orca_mq.server.node_launcher import NodeLauncher

    return NodeLauncher(cfg).run()


def _client(args: argparse.Namespace) -> int:
    from orca_mq.client import DEFAULT_ADDRESS, Client

    sampling: dict[str, Any] = {"max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos}
    for key in ("temperature", "top_p", "top_k", "seed", "structured_outputs"):
        if getattr(args, key) is not None:
            sampling[key] = getattr(args, key)
    with Client(args.address or DEFAULT_ADDRESS) as client:
        if args.json:
            out = client.generate(args.prompt, chat=args.chat, **sampling)
            print(json.dumps({"request_id": out.request_id, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason} | ({"error": out.error} if out.error else {})))
            return 1 if out.finish_reason == "error" else 0
        for ev in client.stream(args.prompt, chat=args.chat, **sampling):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            if ev.finished:
                sys.stdout.write("\n")
                if ev.error:
                    print(f"error: {ev.error}", file=sys.stderr)
                    return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        bench = Path(__file__).resolve().parents[1] / "tools" / "bench.py"
        if not bench.exists():
            raise SystemExit("orca-mq bench needs a source checkout (tools/bench.py)")
        os.execv(sys.executable, [sys.executable, str(bench), *argv[1:]])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "client":
        return _client(args)
    if args.command == "logs":
        from orca_mq.logs import show_logs

        try:
            show_logs(_config(args).log.dir, args.follow, args.lines, args.json)
        except KeyboardInterrupt:
            pass
        return 0
    build_parser().print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
