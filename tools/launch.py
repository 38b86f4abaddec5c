#!/usr/bin/env python
"""Start (or inspect) an orca-mq server: `orca-mq serve` / `orca-mq logs` from an installed
checkout (tools/install.sh: the package editable, so this file imports it from anywhere).

    python tools/launch.py [--model PATH] [--port N] [--config FILE] [--set section.key=value ...]
    python tools/launch.py logs [-f] [-n N] [--json]      # merged structured logs of log.dir
"""
import sys

from orca_mq.cli import COMMANDS, main

if __name__ == "__main__":
    args = sys.argv[1:]
    sys.exit(main(args if args[:1] and args[0] in COMMANDS else ["serve", *args]))
