"""The command line as a newcomer meets it: fast help, a version, one-line errors, no torch in the client."""
from __future__ import annotations

import socket
import subprocess
import sys

from orca_mq.server.process import ROOT, free_port

LAUNCH = [sys.executable, str(ROOT / "tools" / "launch.py")]


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_client_and_help_do_not_import_torch():
    probe = _run(sys.executable, "-c", "import sys, orca_mq.client, orca_mq.cli; "
                 "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", probe.stderr
    help_ = _run(*LAUNCH, "--help")
    assert help_.returncode == 0
    for section in ("[model]", "[engine]", "[scheduler]", "[fastserve]", "[server]", "[log]", "--model", "--port"):
        assert section in help_.stdout


def test_version():
    out = _run(sys.executable, "-m", "orca_mq.cli", "--version")
    assert out.returncode == 0 and out.stdout.startswith("orca-mq ")


def test_config_mistakes_are_one_line():
    for args, words in ((["--set", "scheduler.maxbs=3"], "unknown config key 'scheduler.maxbs'"),
                        (["--set", "scheduler.policy=lifo"], "expected one of orca | request | fastserve"),
                        (["--set", "scheduler.max_bs=many"], "expected int"),
                        (["--model", "/nonexistent/model.gguf"], "does not exist")):
        out = _run(*LAUNCH, *args)
        assert out.returncode != 0 and words in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_busy_port_is_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = _run(*LAUNCH, "--port", str(port))
    assert out.returncode != 0 and "address already in use" in out.stderr.lower(), out.stderr
    assert "Traceback" not in out.stderr


def _one_line(out: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    assert out.returncode == code, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    for w in words:
        assert w in out.stderr, (w, out.stderr)


def test_model_mistakes_are_one_line_with_the_details_in_the_logs(tmp_path):
    empty, corrupt, no_config = tmp_path / "empty.gguf", tmp_path / "corrupt.gguf", tmp_path / "hf"
    empty.write_bytes(b"")
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    no_config.mkdir()
    port = free_port()
    for model, words in ((empty, "not a readable GGUF file"), (corrupt, "not a readable GGUF file"),
                         (no_config, "without config.json")):
        out = _run(*LAUNCH, "--model", str(model), "--port", str(port), "--set", f"log.dir={tmp_path}/logs/{{port}}")
        _one_line(out, 1, "orca-mq: model:", str(model), words, f"details in {tmp_path}/logs/{port}")
    log = (tmp_path / "logs" / str(port) / "launcher.log").read_text()
    assert log.count('"start-up check failed"') == 3 and "Traceback" in log


def test_port_mistakes_name_the_flag_that_moves_them(tmp_path):
    _one_line(_run(*LAUNCH, "--set", "server.http_address=localhost:99999"), 1, "server.http_address", "1-65535")
    _one_line(_run(*LAUNCH, "--set", "server.frontend_address=tcp://127.0.0.1:0x50"), 1, "server.frontend_address")
    _one_line(_run(*LAUNCH, "--port", "99999"), 2, "--port", "1-65535")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        logs = f"log.dir={tmp_path}/{{port}}"
        _one_line(_run(*LAUNCH, "--port", port, "--set", logs), 1, f"127.0.0.1:{port}", "in use", "--port")
        _one_line(_run(*LAUNCH, "--port", str(free_port()), "--http-port", port, "--set", logs), 1, "in use", "--http-port")
    assert not list(tmp_path.iterdir()), "a launch refused at once must not write logs (into another server's dir)"


def test_client_takes_port_or_address():
    _one_line(_run(*LAUNCH[:-1], str(ROOT / "tools" / "client.py"), "--prompt", "x", "--port", "5", "--address", "tcp://h:5"),
              2, "not allowed with argument")
    dead = str(free_port())   # nothing listens: the request ends with `unavailable` after the client's liveness timeout
    probe = _run(sys.executable, "-c", "from orca_mq.cli import build_parser; "
                 f"a = build_parser().parse_args(['client', '--prompt', 'x', '--port', '{dead}']); print(a.port, a.address)")
    assert probe.stdout.split() == [dead, "None"], probe.stderr


def test_logs_reads_the_server_named_or_the_only_running_one(tmp_path):
    import json

    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "orca-mq-launcher-stand-in"])
    for port, text in (("6001", "first server"), ("6002", "second server")):
        (tmp_path / port).mkdir()
        (tmp_path / port / "broker.log").write_text(json.dumps({"ts": "2026-01-01T00:00:00Z", "role": "broker",
                                                                 "level": "info", "event": text}) + "\n")
    logs = [*LAUNCH, "logs", "--set", f"log.dir={tmp_path}/{{port}}"]
    assert "second server" in _run(*logs, "--port", "6002").stdout
    assert "first server" not in _run(*logs, "--port", "6002").stdout
    try:
        assert "second server" in _run(*logs).stdout   # none running: the last one written
        (tmp_path / "6001" / "server.json").write_text(json.dumps({"pid": launcher.pid}))   # running
        out = _run(*logs)
        assert "first server" in out.stdout and "second server" not in out.stdout, out
        (tmp_path / "6002" / "server.json").write_text(json.dumps({"pid": launcher.pid}))
        _one_line(_run(*logs), 1, "2 servers are running", "6001, 6002", "--port")
    finally:
        launcher.kill()
        launcher.wait()
