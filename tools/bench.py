#!/usr/bin/env python3
"""Run one benchmark: generate a trace, replay it against the system, write metrics.

    python tools/bench.py --policy {request,orca,fastserve} --trace {orca,fastserve,chat,multiturn}
        [--num-requests N] [--rate REQ_PER_S] [--cv CV] [--zipf THETA]
        [--input-len MIN:MAX] [--output-len MIN:MAX] [--max-bs B] [--seed S]
        [--system-prompts N] [--system-len L] [--turns T] [--think S]
        [--set section.key=value ...] [--address ADDR] --out FILE.json
        [--backend openai [--base-url URL] [--model NAME] [--extra-body JSON]] [--burstiness K]
        [--goodput ttft:MS tpot:MS e2el:MS] [--client-procs N]

--trace chat / multiturn are issue 22's chat-shaped traces (orca_mq/bench/trace.py): N requests of
one of --system-prompts shared system prompts of --system-len tokens (Zipf popularity --zipf) + a
user turn of --input-len tokens; or N conversations of --turns turns, each turn sent --think
seconds after the previous answer ended, with the conversation so far as its prompt. They are chat
messages: the ZeroMQ client sends them as messages=, the openai backend to /v1/chat/completions.
The table adds the cached prompt tokens the servers report (the final message's metrics;
usage.prompt_tokens_details.cached_tokens over HTTP).

--backend orca-mq (default) replays over the ZeroMQ client; --backend openai over HTTP against any
OpenAI-compatible server (/v1/completions, streamed, the trace's token ids as the prompt): with
--base-url the server is already running (orca-mq's HTTP API, llama.cpp's server, vLLM, ...);
without it the bench launches orca-mq with its HTTP API on a free port and measures through it.

Without --address the system is started here:
    orca-mq serve --set scheduler.policy=P --set scheduler.max_bs=B
        --set server.frontend_address=tcp://127.0.0.1:<free port>
        --set server.backend_address=ipc://<private path> --set server.worker_base_port=<free port>
        --set log.dir=FILE.logs [--set ...]
(the last three only when --set does not give them); the bench waits for a stdout line containing
"ready", replays the trace, then sends the launcher SIGTERM and waits for it to exit. The
launcher's stdout and stderr go to FILE.launch.log. With --address the system is already running
and --policy / --max-bs are only recorded as labels (they must match what the server runs).

Progress goes to stderr, a summary table to stdout, everything to FILE.json:
{"config": {...}, "summary": {...}, "requests": [...]} (see orca_mq/bench/metrics.py), and the
latency CDFs (TTFT, TPOT, ITL, E2E) to FILE.png.
"""
from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import math
import platform
import signal
import sys
import time
from pathlib import Path

from orca_mq.bench.bench_server import on_sigterm
from orca_mq.bench.metrics import format_table, summarize
from orca_mq.bench.result_files import git_rev, write_result
from orca_mq.server.process import ServerHandle, free_port, spawn
from orca_mq.bench.trace import (
    CHAT_KINDS,
    TRACE_KINDS,
    TraceSpec,
    chat_stats,
    default_lengths,
    make_chat_trace,
    make_trace,
    parse_range,
    spec_dict,
    trace_stats,
)

POLICIES = ("request", "orca", "fastserve")
# keys the bench sets itself when it launches the system
OWN_KEYS = ("scheduler.policy", "scheduler.max_bs", "server.frontend_address", "server.http_address")
BACKENDS = ("orca-mq", "openai")


def parse_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"rate must be a number or 'inf', got {text!r}") from None
    if math.isnan(rate) or rate < 0:
        raise argparse.ArgumentTypeError(f"rate must be >= 0 (0 or inf = all requests at t=0), got {text!r}")
    return rate


def _range_arg(text: str) -> tuple[int, int]:
    try:
        return parse_range(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", required=True, choices=POLICIES)
    p.add_argument("--trace", required=True, choices=TRACE_KINDS + CHAT_KINDS)
    p.add_argument("--num-requests", type=int, default=100, metavar="N", help="requests (multiturn: conversations)")
    p.add_argument("--rate", type=parse_rate, default=1.0, metavar="REQ_PER_S",
                   help="mean arrival rate in req/s; inf or 0 = all requests at t=0 (default 1)")
    p.add_argument("--cv", type=float, default=1.0, help="CV of the Gamma inter-arrival times (default 1 = the orca trace's Poisson)")
    p.add_argument("--zipf", type=float, default=1.0, metavar="THETA",
                   help="fastserve trace: Zipf exponent of the lengths, P(min+i) ~ 1/(i+1)^THETA; chat traces: "
                        "of the system prompts' popularity (default 1)")
    lens = {k: default_lengths(k) for k in TRACE_KINDS + CHAT_KINDS}
    p.add_argument("--input-len", type=_range_arg, default=None, metavar="MIN:MAX",
                   help="prompt length range, inclusive; chat traces: the user turn's (default "
                        + ", ".join(f"{k} {i[0]}:{i[1]}" for k, (i, _) in lens.items()) + ")")
    p.add_argument("--output-len", type=_range_arg, default=None, metavar="MIN:MAX",
                   help="max_tokens range, inclusive (default "
                        + ", ".join(f"{k} {o[0]}:{o[1]}" for k, (_, o) in lens.items()) + ")")
    chat = TraceSpec()
    p.add_argument("--system-prompts", type=int, default=chat.system_prompts, metavar="N",
                   help=f"chat traces: shared system prompts, 0 = none (default {chat.system_prompts})")
    p.add_argument("--system-len", type=int, default=chat.system_len, metavar="L",
                   help=f"chat traces: tokens of each system prompt (default {chat.system_len})")
    p.add_argument("--turns", type=int, default=chat.turns, metavar="T",
                   help=f"multiturn: turns per conversation (default {chat.turns})")
    p.add_argument("--think", type=float, default=chat.think_s, metavar="S",
                   help="multiturn: seconds between an answer's end and the next turn (default 0)")
    p.add_argument("--max-bs", type=int, default=None, metavar="B", help="scheduler.max_bs (default: config.toml)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="section.key=value",
                   help="system config override, passed to the launched server (repeatable)")
    p.add_argument("--address", default=None, help="frontend address of a running system (default: launch one)")
    p.add_argument("--backend", choices=BACKENDS, default="orca-mq",
                   help="orca-mq: the ZeroMQ client; openai: HTTP /v1/completions of any OpenAI-compatible server")
    p.add_argument("--base-url", default=None, metavar="URL",
                   help="openai backend: a running server, e.g. http://127.0.0.1:8000 (default: launch orca-mq with HTTP)")
    p.add_argument("--model", default=None, help="openai backend: model name to send (default: the first of /v1/models)")
    p.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                   help='openai backend: fields added to every request, e.g. \'{"cache_prompt": true}\' for llama.cpp')
    p.add_argument("--sampling", type=json.loads, default=None, metavar="JSON",
                   help='orca-mq backend: every request sampled so, e.g. \'{"temperature": 1.0, "seed": 0, "logprobs": 5}\' '
                        '(default greedy; the openai backend takes --extra-body)')
    p.add_argument("--burstiness", type=float, default=None, metavar="K",
                   help="Gamma arrivals with shape K (CV = 1/sqrt(K); 1 = Poisson), either trace, as vllm bench serve")
    p.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 (e2el too): ok requests meeting all, per second")
    p.add_argument("--out", required=True, metavar="FILE.json")
    p.add_argument("--warmup", type=int, default=1, help="untimed short requests sent before the trace (default 1)")
    p.add_argument("--request-timeout", type=float, default=0.0, metavar="S",
                   help="give up on a request after S seconds (0 = never; default)")
    p.add_argument("--launch-timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for the launcher to print 'ready' (default 600)")
    p.add_argument("--launch-log", default=None, metavar="FILE", help="launcher output (default FILE.launch.log)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--client-procs", type=int, default=1, metavar="N",
                   help="replay from N client processes, each its share of the trace and its own warm-up (default 1; "
                        "no progress bar when > 1): one Python client spends ~60 us per token, a bottleneck at high rates")
    return p


# ---------------------------------------------------------------- launching the system

def run_replay(address: str, trace: list, args: argparse.Namespace) -> tuple[list[dict], float]:
    from orca_mq.bench.client_procs import replay_in_processes, run_loop
    from orca_mq.bench.openai_backend import OpenAIClient
    from orca_mq.bench.replay import SampledClient, open_client, replay

    factory = functools.partial(OpenAIClient, model=args.model, extra=args.extra_body) if args.backend == "openai" else \
        functools.partial(SampledClient, sampling=args.sampling) if args.sampling else open_client
    timeout = args.request_timeout or None
    if args.client_procs > 1:
        return replay_in_processes(address, trace, args.client_procs, warmup=args.warmup, request_timeout=timeout,
                                   client_factory=factory)[:2]
    return run_loop(replay(address, trace, progress=not args.no_progress, warmup=args.warmup, request_timeout=timeout,
                           client_factory=factory))


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from orca_mq.bench.trace import load_corpus
    from orca_mq.config import load_config
    from orca_mq.tokenizer import load_tokenizer

    signal.signal(signal.SIGTERM, on_sigterm)  # so `finally` stops the launcher when we are terminated
    out = Path(args.out)
    if args.base_url and args.backend != "openai":
        sys.exit("bench: --base-url needs --backend openai")
    if args.client_procs < 1:
        sys.exit("bench: --client-procs must be >= 1")
    if args.sampling is not None:
        from orca_mq.protocol.sampling import SamplingParams

        if args.backend == "openai":
            sys.exit("bench: --sampling is the orca-mq backend's; give the openai backend --extra-body")
        if "temperature" not in args.sampling or {"max_tokens", "ignore_eos"} & set(args.sampling):
            sys.exit("bench: --sampling needs a temperature (without one the replay is greedy) and takes no max_tokens "
                     "or ignore_eos (the trace sets them)")
        try:
            SamplingParams.from_dict({"max_tokens": 1, **args.sampling}).validate()   # as the client checks it
        except (TypeError, ValueError) as e:
            sys.exit(f"bench: bad --sampling: {e}")
    if args.burstiness is not None:
        if not args.burstiness > 0:
            sys.exit("bench: --burstiness must be > 0")
        args.cv = 1.0 / math.sqrt(args.burstiness)
    try:
        from orca_mq.bench.metrics import parse_goodput

        slos = parse_goodput(args.goodput)
    except ValueError as e:
        sys.exit(f"bench: {e}")
    launched = args.address is None and args.base_url is None

    for s in args.sets:
        key = s.split("=", 1)[0].strip()
        if "=" not in s:
            sys.exit(f"bench: --set {s!r} is not section.key=value")
        if launched and key in OWN_KEYS:
            sys.exit(f"bench: --set {key}: use --policy / --max-bs (the bench picks the frontend address when it launches)")
    try:
        cfg = load_config(overrides=list(args.sets) + [f"scheduler.policy={args.policy}"])
    except (KeyError, ValueError) as e:
        sys.exit(f"bench: bad --set: {e}")
    if args.max_bs is None:
        args.max_bs = cfg.scheduler.max_bs
    cfg.set("scheduler.max_bs", args.max_bs)

    in_len, out_len = default_lengths(args.trace)
    spec = TraceSpec(kind=args.trace, num_requests=args.num_requests, rate=args.rate, cv=args.cv, zipf=args.zipf,
                     input_len=args.input_len or in_len, output_len=args.output_len or out_len, seed=args.seed,
                     system_prompts=args.system_prompts, system_len=args.system_len, turns=args.turns,
                     think_s=args.think)
    try:
        spec.validate()
    except ValueError as e:
        sys.exit(f"bench: {e}")
    chat = args.trace in CHAT_KINDS
    turns = spec.turns if args.trace == "multiturn" else 1
    longest = spec.input_len[1] + spec.output_len[1] if not chat else \
        spec.system_len * (spec.system_prompts > 0) + turns * (spec.input_len[1] + spec.output_len[1])
    if longest > cfg.model.max_model_len:
        print(f"bench: warning: input max + output max = {longest} > model.max_model_len = {cfg.model.max_model_len}; "
              f"the longest requests will be rejected", file=sys.stderr)

    t_prep = time.perf_counter()
    tok = load_tokenizer(cfg.model.path, cfg.model.cache_dir)
    corpus = load_corpus(tok)
    trace = make_chat_trace(spec, corpus, tok.decode) if chat else make_trace(spec, corpus)
    last = max(t.delay_s for t in trace if t.turn == 0) if chat else trace[-1].arrival_s
    span = f"over {last:.1f} s" + (", each conversation's turns closed loop" if args.trace == "multiturn" else "")
    print(f"bench: trace {args.trace}: {len(trace)} requests {span} "
          f"(corpus {len(corpus)} tokens, built in {time.perf_counter() - t_prep:.1f} s)", file=sys.stderr)

    launch_sets: list[str] = []
    launcher: ServerHandle | None = None
    address = args.base_url if args.backend == "openai" else args.address
    if launched:
        address = f"tcp://127.0.0.1:{free_port()}"
        user_keys = {s.split("=", 1)[0].strip() for s in args.sets}
        http = f"127.0.0.1:{free_port()}" if args.backend == "openai" else ""
        launch_sets = [f"scheduler.policy={args.policy}", f"scheduler.max_bs={args.max_bs}",
                       f"server.frontend_address={address}", f"server.http_address={http}"]
        if http:
            address = f"http://{http}"
        if "log.dir" not in user_keys:  # the system's logs next to the result
            launch_sets.append(f"log.dir={out.resolve().with_name(out.stem + '.logs')}")
        launch_sets += list(args.sets)
        for s in launch_sets:
            cfg.set(*s.split("=", 1))
        log_path = Path(args.launch_log) if args.launch_log else out.with_name(out.stem + ".launch.log")

    started_at = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    launcher_rc = None
    try:
        if launched:
            t = time.perf_counter()
            print(f"bench: starting the system ({args.policy}, max_bs={args.max_bs}) at {address}; log {log_path}",
                  file=sys.stderr)
            launcher = spawn(dict(item.split("=", 1) for item in launch_sets), log_path, ready_timeout=args.launch_timeout)
            print(f"bench: system ready in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        records, wall_start = run_replay(address, trace, args)
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    finally:
        if launcher is not None:
            launcher_rc = launcher.stop(cfg.server.drain_timeout + 30.0)
            print(f"bench: the launcher exited with code {launcher_rc}", file=sys.stderr)

    summary = summarize(records, slos)
    config = {
        "backend": args.backend, "model": args.model, "burstiness": args.burstiness, "goodput": list(args.goodput),
        "policy": args.policy, "trace": args.trace, "num_requests": args.num_requests, "rate": args.rate,
        "cv": args.cv, "zipf": args.zipf, "input_len": list(spec.input_len), "output_len": list(spec.output_len),
        "max_bs": args.max_bs, "seed": args.seed, "set": list(args.sets), "address": address, "launched": launched,
        "out": str(out), "warmup": args.warmup, "request_timeout": args.request_timeout, "client_procs": args.client_procs,
        "launch_sets": launch_sets,
        # the effective system config: exact when launched here, config.toml + --set when --address is used
        "system": cfg.to_dict(),
        "trace_spec": spec_dict(spec),
        "extra_body": args.extra_body,
        "sampling": args.sampling or "greedy",
        "trace_stats": chat_stats(trace) if chat else trace_stats(trace),
        "started_at": started_at, "wall_start": wall_start, "git_rev": git_rev(), "host": platform.node(),
        "launcher_exit_code": launcher_rc,
    }
    write_result(out, config, summary, records)
    from orca_mq.bench.plot_run import plot_cdfs

    plot = plot_cdfs({f"{args.backend} {args.policy}": records}, out.with_suffix(".png"), f"{args.trace} trace, {address}")

    rate = "inf" if math.isinf(args.rate) or args.rate == 0 else f"{args.rate:g} req/s"
    extra = f", cv={args.cv:g}, zipf={args.zipf:g}" if args.trace == "fastserve" else ""
    if chat:
        extra = (f", {spec.system_prompts} system prompts x {spec.system_len} (zipf={args.zipf:g})"
                 + (f", {turns} turns, think {spec.think_s:g} s" if turns > 1 else ""))
    print(f"policy={args.policy} max_bs={args.max_bs} trace={args.trace} rate={rate}{extra} "
          f"n={args.num_requests} seed={args.seed} sampling={json.dumps(args.sampling) if args.sampling else 'greedy'}")
    print(format_table(summary))
    print(f"wrote {out} and {plot}")
    return 0 if summary["n_ok"] > 0 else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # before the system was started: nothing to clean up
        print("bench: interrupted", file=sys.stderr)
        sys.exit(130)
