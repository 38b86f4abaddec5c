#!/usr/bin/env python
"""A newcomer's first hour, as a script: set up and serve the way the README's quick start says, run
every example of the README against that server, then make the mistakes a new user makes.

1. The README's first two commands must be the whole set-up (`--install` runs the first one's
   `bash tools/install.sh` too; by default the environment is taken as installed).
2. Every fenced bash line and python block of the README runs, in order, against the server of the
   launch line before it (`python tools/launch.py`, `orca-mq serve`, with the environment they set):
   each launch gets free ports in place of 5555 / 8000 (never the shared defaults) and its logs in a
   temporary directory (never the checkout's logs/, `orca-mq logs` reads them there), `~/.orca-keys`
   a temporary directory, other hosts' addresses loopback. A line must exit 0, a curl must not
   answer an error object. Skipped, and said so: placeholders (`/path/to/`), other hosts'
   launchers, tensor parallelism, benchmarks and their peer, the test suite (tests/ runs it).
3. The mistakes: `max_tokens` 1e30 over HTTP and from the Python client, a misspelt field, empty
   and corrupt .gguf files, a directory without config.json, a hub id, a negative max_bs, a port out
   of range, each busy port, a client given an http:// URL or the HTTP port, two clients with one request id; and after all of it, no traceback on any server's terminal, the
   dtype choice in the logs.

Prints a table (ok / FAIL / skip per step) and writes JSON (`--out`); exit status 1 if a step failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from orca_mq.client import AsyncClient
from orca_mq.server.process import ROOT, ServerHandle, free_port, spawn

SETUP = ["bash tools/install.sh && python tools/launch.py", "bash tools/install.sh && python3 -m pytest -q"]
SKIP = {"/path/to/": "a placeholder path", "--node-rank 1": "another host's launcher", "tp_size": "tensor parallelism "
        "(tests/test_tensor_parallel.py)", "bench": "a benchmark", "peer": "a benchmark's peer", "venv": "a benchmark's peer",
        "pytest": "the test suite", "install.sh": "the install (--install)", "--nnodes": "many hosts (tests/test_multinode.py)"}
LAUNCH = re.compile(r"^((?:\w+=\S+ )*)(python tools/launch\.py|orca-mq serve)\b(.*)$")


@dataclass
class Step:
    what: str
    status: str = "ok"      # ok | FAIL | skip
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Newcomer:
    tmp: Path
    install: bool
    steps: list[Step] = field(default_factory=list)
    servers: dict[str, tuple[ServerHandle, int, int]] = field(default_factory=dict)   # launch line -> (server, zmq, http)
    current: str = ""

    def step(self, what: str, fn, *args) -> None:  # noqa: ANN001
        t = time.perf_counter()
        step = Step(what)
        try:
            step.detail = fn(*args) or ""
        except Skip as e:
            step.status, step.detail = "skip", str(e)
        except Exception as e:  # a step's failure is reported, and the next step runs
            step.status, step.detail = "FAIL", f"{type(e).__name__}: {e}"[:600]
        step.seconds = time.perf_counter() - t
        self.steps.append(step)
        print(f"{step.status:<5} {step.seconds:6.1f}s  {what[:90]}" + (f"\n      {step.detail}" if step.detail else ""), flush=True)

    @property
    def ports(self) -> tuple[int, int]:
        return self.servers[self.current][1:]

    # ---------------------------------------------------------------- the README

    def readme(self) -> None:
        blocks = re.findall(r"```(bash|python)\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
        firsts = [b for kind, b in blocks[:2]]
        self.step("the README's first two commands are the whole set-up", _same, [b.strip() for b in firsts], SETUP)
        if self.install:
            self.step("bash tools/install.sh", self.shell, "bash tools/install.sh", 1800)
        for kind, text in blocks:
            if "--nnodes" in text:
                self.step(f"bash: {text.strip().splitlines()[0]} ...", _skip, "many hosts, the block as a whole "
                          "(tests/test_multinode.py)")
                continue
            if kind == "python":
                self.step(f"python: {text.strip().splitlines()[-1]}", self.python, text)
                continue
            for line in _lines(text):
                for part in ([line.split(" && ", 1)[1]] if line.startswith("bash tools/install.sh && ") else [line]):
                    self.step(part, self.bash, part)

    def bash(self, line: str) -> str:
        if reason := next((why for key, why in SKIP.items() if key in line), None):
            raise Skip(reason)
        if m := LAUNCH.match(line):
            return self.launch(m.group(1), m.group(3))
        if not self.current:
            raise RuntimeError("an example before any launch line")
        line = self.substitute(line)
        if line.startswith("orca-mq client") and " --port " not in line and " --address " not in line:
            line += f" --port {self.ports[0]}"
        if line.startswith("orca-mq logs"):
            line += f" --set log.dir={self.log_dirs}"
        out = self.shell(line.replace("orca-mq ", f"{_orca_mq()} ", 1) if line.startswith("orca-mq") else line, 300)
        if line.startswith("curl") and out.lstrip().startswith('{"error"'):
            raise RuntimeError(f"an error object: {out[:300]}")
        return out.strip().splitlines()[-1][:200] if out.strip() else ""

    def launch(self, env: str, args: str) -> str:
        key = f"{env.strip()} {args.strip()}"
        if key in self.servers:
            self.current = key
            return "the same server as before"
        zmq_port, http_port = free_port(), free_port()
        sets = dict(re.findall(r"--set (\S+?)=(\S+)", self.substitute(args, zmq_port, http_port)))
        sets |= {"server.frontend_address": f"tcp://127.0.0.1:{zmq_port}", "server.http_address": f"127.0.0.1:{http_port}",
                 "log.dir": self.log_dirs}   # never into the checkout
        env_vars = dict(item.split("=", 1) for item in env.split())
        handle = spawn(sets, self.tmp / f"server{len(self.servers)}.stderr", env=env_vars, ready_timeout=600)
        self.servers[key], self.current = (handle, zmq_port, http_port), key
        return f"{handle.ready_line} (HTTP on {http_port})"

    @property
    def log_dirs(self) -> str:
        """log.dir of every server it starts: under its temporary directory, as the checkout's would be."""
        return f"{self.tmp}/logs/{{port}}"

    def substitute(self, text: str, zmq_port: int | None = None, http_port: int | None = None) -> str:
        zmq_port, http_port = (zmq_port, http_port) if zmq_port else self.ports
        for old, new in (("0.0.0.0", "127.0.0.1"), ("10.0.0.1", "127.0.0.1"), ("~/.orca-keys", str(self.tmp / "keys")),
                         ("--server-key server.key", f"--server-key {self.tmp / 'keys' / 'server.key'}"),
                         ("5555", str(zmq_port)), ("5600", str(zmq_port)), ("8000", str(http_port)), ("8100", str(http_port))):
            text = text.replace(old, new)
        return text

    def python(self, code: str) -> str:
        if "LLM(" not in code and not self.current:
            raise RuntimeError("an example before any launch line")
        script = self.tmp / "example.py"
        script.write_text(self.substitute(code) if self.current else code)
        return self.shell(f"{shlex.quote(sys.executable)} {script}", 600).strip()[-200:]

    def shell(self, line: str, timeout: float) -> str:
        env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        assignments = re.match(r"^((?:\w+=\S+ )*)(.*)$", line, re.S)
        assert assignments is not None
        env |= dict(item.split("=", 1) for item in assignments.group(1).split())
        out = subprocess.run(assignments.group(2), shell=True, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"exit {out.returncode}: {(out.stderr or out.stdout).strip()[-400:]}")
        return out.stdout

    # ---------------------------------------------------------------- the mistakes

    def mistakes(self) -> None:
        self.current = next(k for k in self.servers if "API_KEY" not in k and "curve" not in k)
        zmq_port, http_port = self.ports
        http = f"http://127.0.0.1:{http_port}/v1/completions"
        self.step("HTTP max_tokens 10**30: 400 naming max_tokens", self.http_error, http,
                  '{"prompt": "hi", "max_tokens": 1000000000000000000000000000000}', "max_tokens")
        self.step("HTTP max_tokens 1e30: 400 naming max_tokens", self.http_error, http, '{"prompt": "hi", "max_tokens": 1e30}', "max_tokens")
        self.step("HTTP 'temprature': 400 naming it", self.http_error, http, '{"prompt": "hi", "temprature": 0}', "temprature")
        self.step("Python client max_tokens=10**30: an invalid_request final", self.client_overflow, zmq_port)
        self.step("two clients, one request id: each served its own", self.same_id, zmq_port)
        bad = self.tmp / "models"
        bad.mkdir(exist_ok=True)
        (bad / "empty.gguf").write_bytes(b"")
        (bad / "corrupt.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 8)
        (bad / "hf").mkdir(exist_ok=True)
        log_dir = self.tmp / "logs" / str(zmq_port)
        before = {p.name: p.stat().st_size for p in log_dir.glob("*.log")}
        elsewhere = f"--port {free_port()} --http-port {free_port()}"
        for args, words in ((f"--port {zmq_port}", "--port"), (f"--port {free_port()} --http-port {http_port}", "--http-port"),
                            ("--set server.http_address=localhost:99999", "1-65535"),
                            (f"--model {bad / 'empty.gguf'} {elsewhere}", "not a readable GGUF"),
                            (f"--model {bad / 'corrupt.gguf'} {elsewhere}", "not a readable GGUF"),
                            (f"--model {bad / 'hf'} {elsewhere}", "without config.json"),
                            (f"--model HuggingFaceTB/SmolLM2-135M {elsewhere}", "does not download"),
                            (f"--set scheduler.max_bs=-3 {elsewhere}", "scheduler.max_bs must be >= 1")):
            self.step(f"orca-mq serve {args.split(' --port')[0] if '--model' in args else args}: one line", self.one_line,
                      f"{_orca_mq()} serve {args} --set log.dir={self.log_dirs}", words)
        after = {p.name: p.stat().st_size for p in log_dir.glob("*.log")}
        self.step("the refused launches wrote nothing into the running server's logs", _same, after, before)
        client = f"{_orca_mq()} client --prompt hi --max-tokens 2"
        self.step("orca-mq client --address http://...: one line naming --port", self.one_line,
                  f"{client} --address http://127.0.0.1:{http_port}/v1", "--port")
        self.step("orca-mq client --address at the HTTP port: one line within seconds", self.one_line,
                  f"{client} --address 127.0.0.1:{http_port}", "no orca-mq server answers")
        self.step("orca-mq client --address host:port (no tcp://)", self.shell, f"{client} --address 127.0.0.1:{zmq_port}", 60)
        self.step("the model.dtype=auto choice is in the logs", self.dtype_logged, log_dir)

    def http_error(self, url: str, body: str, param: str) -> str:
        out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", url, "-H", "content-type: application/json", "-d", body],
                             capture_output=True, text=True, timeout=60).stdout
        text, status = out.rsplit("\n", 1)
        err = json.loads(text)["error"]
        if status != "400" or err["param"] != param or err["type"] != "invalid_request_error":
            raise RuntimeError(f"{status} {text}")
        return err["message"]

    def client_overflow(self, zmq_port: int) -> str:
        async def run() -> str:
            async with AsyncClient(f"tcp://127.0.0.1:{zmq_port}") as c:
                out = await c.generate("hi", max_tokens=10**30)
            if out.code != "invalid_request":
                raise RuntimeError(f"{out}")
            return out.error or ""
        return asyncio.run(run())

    def same_id(self, zmq_port: int) -> str:
        async def one(prompt: str) -> tuple[str, str]:
            async with AsyncClient(f"tcp://127.0.0.1:{zmq_port}") as c:
                alone = await c.generate(prompt, request_id="mine", max_tokens=6, temperature=0, ignore_eos=True)
            return prompt, alone.text

        async def run() -> str:
            first = await asyncio.gather(one("The capital of France is"), one("1, 2, 3,"))
            again = await asyncio.gather(one("The capital of France is"), one("1, 2, 3,"))   # at once, the same id
            if first != again or first[0][1] == first[1][1]:
                raise RuntimeError(f"{first} != {again}")
            return str(again)
        return asyncio.run(run())

    def one_line(self, line: str, words: str) -> str:
        out = subprocess.run(line, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300)
        lines = out.stderr.strip().splitlines()
        if out.returncode not in (1, 2) or len(lines) != 1 or words not in lines[0] or "Traceback" in out.stderr:
            raise RuntimeError(f"exit {out.returncode}: {out.stderr.strip()[-500:]}")
        return lines[0]

    def dtype_logged(self, log_dir: Path) -> str:
        lines = [json.loads(x) for x in (log_dir / "worker0.log").read_text().splitlines()]
        loaded = [x for x in lines if x.get("event") == "stage loaded"]
        if not loaded or "dtype" not in loaded[-1]:
            raise RuntimeError("no 'stage loaded' line with the dtype")
        auto = [x["event"] for x in lines if str(x.get("event", "")).startswith("model.dtype auto")]
        return f"dtype {loaded[-1]['dtype']}" + (f"; {auto[-1]}" if auto else "")

    def stop(self) -> None:
        for key, (handle, _, _) in self.servers.items():
            code = handle.stop()
            stderr = handle.stderr()
            self.step(f"stop {key.strip() or 'the quick-start server'}: exit 0, no traceback on its terminal", _same,
                      (code, "Traceback" in stderr), (0, False))


class Skip(Exception):
    pass


def _skip(reason: str) -> str:
    raise Skip(reason)


def _same(got: object, want: object) -> str:
    if got != want:
        raise RuntimeError(f"{got!r} != {want!r}")
    return ""


def _lines(text: str) -> list[str]:
    """A bash block's commands: continuations joined (also a quoted string over several lines), comments
    (`  # ...` after a command) and blank lines dropped."""
    out, buffer = [], ""
    for line in re.sub(r"\\\n\s*", "", text).splitlines():
        buffer = f"{buffer}\n{line}" if buffer else line
        try:
            words = shlex.split(buffer, comments=True)
        except ValueError:   # an open quote: the command goes on
            continue
        if words:
            out.append(re.split(r"\s{2,}#", buffer)[0].strip())
        buffer = ""
    return out


def _orca_mq() -> str:
    return shutil.which("orca-mq") or f"{shlex.quote(sys.executable)} -m orca_mq.cli"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", action="store_true", help="run tools/install.sh first, as the quick start does")
    ap.add_argument("--out", default="results/newcomer.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="orca-newcomer-") as tmp:
        me = Newcomer(Path(tmp), args.install)
        try:
            me.readme()
            me.mistakes()
        finally:
            me.stop()
    failed = [s for s in me.steps if s.status == "FAIL"]
    counts = {k: sum(s.status == k for s in me.steps) for k in ("ok", "FAIL", "skip")}
    print(f"\n{counts['ok']} ok, {counts['FAIL']} failed, {counts['skip']} skipped, "
          f"{sum(s.seconds for s in me.steps):.0f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"counts": counts, "steps": [vars(s) for s in me.steps]}, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
