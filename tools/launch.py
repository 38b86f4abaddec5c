#!/usr/bin/env python
"""Start (or inspect) an orca-mq server: the same as the `orca-mq serve` / `orca-mq logs` commands.

    python tools/launch.py [--config config.toml] [--set section.key=value ...]
    python tools/launch.py logs [-f] [-n N] [--json]      # merged structured logs of log.dir
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from orca_mq.server.launcher import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
