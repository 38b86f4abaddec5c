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


def test_config_mistakes_are_one_line(tmp_path):
    for args, words in ((["--set", "scheduler.maxbs=3"], "unknown config key 'scheduler.maxbs' (did you mean scheduler.max_bs?)"),
                        (["--set", "engine.max_bs=3"], "unknown config key 'engine.max_bs' (did you mean scheduler.max_bs?)"),
                        (["--set", "scheduler.policy=lifo"], "expected one of orca | request | fastserve"),
                        (["--set", "scheduler.max_bs=many"], "expected int"),
                        (["--model", "/nonexistent/model.gguf"], "does not exist")):
        out = _run(*LAUNCH, *args, "--set", f"log.dir={tmp_path}/logs")   # the refused start logs its details
        assert out.returncode != 0 and words in out.stderr, (args, out.stderr)
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_mistyped_option_names_the_close_one():
    """argparse alone asked for the required --prompt that `--promt` hides (issue 43)."""
    client = [*LAUNCH[:-1], str(ROOT / "tools" / "client.py")]
    _one_line(_run(*client, "--promt", "Hi"), 2, "unrecognized argument --promt: did you mean --prompt?")
    _one_line(_run(*LAUNCH, "--modle", "x.gguf"), 2, "did you mean --model?")
    _one_line(_run(sys.executable, "-m", "orca_mq.cli", "logs", "--folow"), 2, "did you mean --follow?")
    _one_line(_run(*client, "--prompt", "Hi", "--xyz"), 2, "unrecognized arguments: --xyz")   # nothing close: argparse's


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


def test_numeric_knobs_are_checked_at_once():
    from orca_mq.config import RANGES, numeric_keys

    assert set(RANGES) == set(numeric_keys()), "every int and float knob needs its range in orca_mq/config.py RANGES"
    for args, words in ((["--set", "scheduler.max_bs=-3"], "scheduler.max_bs must be >= 1, got -3"),
                        (["--set", "server.drain_timeout=nan"], "server.drain_timeout must be >= 0"),
                        (["--set", "server.node_rank=1"], "below server.nnodes")):
        _one_line(_run(*LAUNCH, *args), 1, words)


def test_serve_flags_for_the_http_api():
    from orca_mq.cli import _config, build_parser

    def cfg(*argv: str):
        return _config(build_parser().parse_args(["serve", *argv])).server

    assert cfg("--host", "0.0.0.0").http_address == "0.0.0.0:8000"   # the configured port on that host
    assert cfg("--host", "::", "--http-port", "8100").http_address == "[::]:8100"
    assert cfg("--http-port", "8100").http_address == "127.0.0.1:8100"
    assert cfg("--served-model-name", "smol", "org/model").served_names() == ("smol", "org/model")
    assert cfg().served_names() == ()
    _one_line(_run(*LAUNCH, "--served-model-name", "a,b"), 2, "without commas")
    _one_line(_run(*LAUNCH, "--host", "0.0.0.0", "--set", "server.http_address="), 1, "--host needs the HTTP API")


def test_model_directory_and_hub_id_mistakes_say_what_is_wrong(tmp_path):
    import json

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10, "hidden_size": 8}))
    logs = f"log.dir={tmp_path}/logs/{{port}}"
    _one_line(_run(*LAUNCH, "--model", str(hf), "--port", str(free_port()), "--set", logs), 1,
              f"{hf / 'config.json'} lacks the key 'num_attention_heads'")
    _one_line(_run(*LAUNCH, "--model", "HuggingFaceTB/SmolLM2-135M", "--port", str(free_port()), "--set", logs), 1,
              "does not exist: HuggingFaceTB/SmolLM2-135M", "hub id", "does not download")


def test_ctrl_c_during_start_up_exits_130(tmp_path):
    import signal
    import time

    proc = subprocess.Popen([*LAUNCH, "--port", str(free_port()), "--set", "server.http_address=",
                             "--set", f"log.dir={tmp_path}/{{port}}"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        import select

        assert proc.stderr is not None
        deadline, line = time.monotonic() + 60, ""
        while "loading the model" not in line:   # the broker is up, the workers are starting
            assert time.monotonic() < deadline and proc.poll() is None, "no 'loading the model' line"
            line = proc.stderr.readline() if select.select([proc.stderr], [], [], 0.5)[0] else ""
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
        out, err = proc.communicate()
        assert "ready on" not in out and "interrupted during start-up" in err and "Traceback" not in err, err
    finally:
        proc.kill()
        proc.wait()


def test_client_address_mistakes_are_one_line_and_quick():
    import time

    client = [*LAUNCH[:-1], str(ROOT / "tools" / "client.py"), "--prompt", "x"]
    _one_line(_run(*client, "--address", "http://127.0.0.1:8000/v1"), 1, "HTTP URL", "--port")
    _one_line(_run(*client, "--address", "localhost"), 1, "expected tcp://HOST:PORT")
    t0 = time.monotonic()   # host:port without tcp://, and nothing there: said within seconds
    out = _run(*client, "--address", f"localhost:{free_port()}")
    assert time.monotonic() - t0 < 12, "the client waited for its liveness timeout"
    assert out.returncode == 1 and "no orca-mq server answers at tcp://localhost:" in out.stderr and "--port" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr


class _FakeBroker:
    """A ROUTER on a free port that answers pings, records what clients send and never answers a request."""

    def __init__(self) -> None:
        import threading

        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.seen: list[str] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        from orca_mq.protocol import encode, unpack
        from orca_mq.protocol.client_msgs import Pong

        while not self.stopping.is_set():
            if not self.sock.poll(100):
                continue
            client, payload = self.sock.recv_multipart()
            body = unpack(payload)
            self.seen.append(body["type"])
            if body["type"] == "ping":
                self.sock.send_multipart([client, encode(Pong(body["nonce"], "fake", 0))])

    def wait_for(self, kind: str, timeout: float = 30) -> None:
        import time

        deadline = time.monotonic() + timeout
        while kind not in self.seen:
            assert time.monotonic() < deadline, (kind, self.seen)
            time.sleep(0.05)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()
        self.sock.close(linger=0)
        self.ctx.term()


def test_ctrl_c_in_the_client_is_one_line_and_status_130():
    """Ctrl-C while a request waits: `orca-mq client` (streaming or --json) prints one line and exits 130,
    the request is aborted; a program around Client.stream gets the KeyboardInterrupt itself."""
    import signal

    library = ("import sys\nfrom orca_mq.client import Client\n"
               "with Client(sys.argv[1]) as c:\n"
               "    try:\n"
               "        for ev in c.stream('x', max_tokens=4):\n"
               "            pass\n"
               "    except KeyboardInterrupt:\n"
               "        print('caught KeyboardInterrupt')\n")
    runs = {"stream": ["--port"], "json": ["--json", "--port"], "library": None}
    for name, flags in runs.items():
        broker = _FakeBroker()
        try:
            cmd = ([sys.executable, "-c", library, f"tcp://127.0.0.1:{broker.port}"] if flags is None else
                   [sys.executable, "-m", "orca_mq.cli", "client", "--prompt", "x", *flags, str(broker.port)])
            proc = subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            broker.wait_for("generate")
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
            broker.wait_for("abort", timeout=10)   # the request was aborted on the way out
        finally:
            broker.close()
        assert "Traceback" not in err, (name, err)
        if flags is None:
            assert (proc.returncode, out.strip(), err) == (0, "caught KeyboardInterrupt", ""), (name, proc.returncode, out, err)
        else:
            assert proc.returncode == 130 and err.strip() == "orca-mq client: interrupted", (name, proc.returncode, err)


def test_logs_knows_a_launcher_whatever_its_command_line(tmp_path):
    """`python tools/launch.py` names no orca-mq on its command line: the marker's pid and start time say it
    runs; a marker whose pid now belongs to another process (another start time) is not a running server."""
    import json

    from orca_mq.logs import _running, process_started

    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (tmp_path / "server.json").write_text(json.dumps({"pid": stand_in.pid, "started": process_started(stand_in.pid)}))
        assert _running(tmp_path)
        (tmp_path / "server.json").write_text(json.dumps({"pid": stand_in.pid, "started": 1}))
        assert not _running(tmp_path)
    finally:
        stand_in.kill()
        stand_in.wait()
    (tmp_path / "server.json").write_text(json.dumps({"pid": stand_in.pid, "started": process_started(stand_in.pid)}))
    assert not _running(tmp_path)
