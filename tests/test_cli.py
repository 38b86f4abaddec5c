"""The command line as a newcomer meets it: fast help, a version, one-line errors, no torch in the client."""
from __future__ import annotations

import socket
import subprocess
import sys

from orca_mq.server.process import ROOT

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
