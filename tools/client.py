#!/usr/bin/env python
"""Send one request to an orca-mq server and stream the text to stdout.

    python tools/client.py --prompt "Hello" [--chat] [--max-tokens N] [--temperature T] [--top-p P]
                           [--seed S] [--ignore-eos] [--json] [--address ADDR]

With --json, prints one final JSON line {"request_id", "text", "token_ids", "finish_reason"}.
Exit status 1 when the request ends with an error.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orca_mq.client import DEFAULT_ADDRESS, Client  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action="store_true", help="treat the prompt as a user message (chat template)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one final JSON line instead of streaming")
    p.add_argument("--address", default=DEFAULT_ADDRESS)
    args = p.parse_args(argv)
    sampling: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                                "top_p": args.top_p, "ignore_eos": args.ignore_eos}
    if args.seed is not None:
        sampling["seed"] = args.seed
    with Client(args.address) as client:
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


if __name__ == "__main__":
    sys.exit(main())
