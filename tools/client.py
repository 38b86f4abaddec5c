#!/usr/bin/env python
"""Send one request to an orca-mq server and stream the text: `orca-mq client` from an installed
checkout (tools/install.sh).

    python tools/client.py --prompt "Hello" [--chat] [--max-tokens N] [--temperature T] [--top-p P]
                           [--seed S] [--ignore-eos] [--json] [--address ADDR]

With --json, prints one final JSON line {"request_id", "text", "token_ids", "finish_reason"}.
Exit status 1 when the request ends with an error.
"""
import sys

from orca_mq.cli import main

if __name__ == "__main__":
    sys.exit(main(["client", *sys.argv[1:]]))
