"""The CPU kernels of csrc/ (the paged decode attention, a Llama layer's elementwise ops, few-row GEMMs, the
sampling step), one extension built on first use.

torch.utils.cpp_extension compiles it once per machine, environment and source (about 40 s, with the
machine's own vector width; one line on stderr says so) into torch's extension cache; later processes load the cached build, and
concurrent builders wait on its lock. The sources are built inline (copied into the cache's own
directory) under a name carrying their hash: checkouts at other paths or with another version of the
kernels share or keep their builds instead of rebuilding over each other. `load()` returns None when
it cannot be built (no compiler), so the engine falls back to torch's ops (gather + SDPA) and says so.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / "paged_decode_cpu.cpp", CSRC / "layer_ops_cpu.cpp", CSRC / "linear_rows_cpu.cpp", CSRC / "sample_cpu.cpp",
           CSRC / "processors_cpu.cpp", CSRC / "bindings.cpp"]   # bindings last
# -ffast-math lets gcc vectorize exp and the dot-product reductions; the kernels keep their
# arithmetic finite (no inf sentinel) so that flag is safe, and processors_cpu.cpp turns it off for
# itself (a pragma), where the logits must be torch's to the bit
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
LDFLAGS = ["-fopenmp"]


def _build_name(source: str) -> str:
    """-march=native code must not load on another CPU sharing the cache (a network home, an image):
    the name, hence the cache directory, carries the CPU's instruction-set flags and the source's hash;
    and the environment's build (`_environment`), so that two environments on one machine keep a build
    each instead of rebuilding over each other at every start (ninja rebuilds when its command changes)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    digest = hashlib.sha1("\0".join([flags, _environment(), source]).encode()).hexdigest()[:12]
    return f"orca_mq_cpu_kernels_{platform.machine()}_{digest}"


@functools.cache
def _environment() -> str:
    """What the build command depends on beside the source: torch (version and install, whose headers and
    libraries it names), Python's headers, the compiler (torch's choice: $CXX or c++, and its version) and
    the flags."""
    import sysconfig

    import torch

    compiler = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""   # no compiler: the build fails and says so
    return repr((torch.__version__, str(Path(torch.__file__).parent), sysconfig.get_paths().get("include"),
                 compiler, shutil.which(compiler), version, CFLAGS, LDFLAGS))


@functools.cache
def load() -> ModuleType | None:
    """The extension (None if it cannot be built here): paged_decode_attention(q [B,H,d], k_cache,
    v_cache [NB,bs,kvh,d], block_tables [B,nb], seq_lens [B] int32, scale) -> [B,H,d]; rms_norm,
    rotary_, silu_mul (orca_mq/engine/layer_ops.py); float32 or bfloat16 CPU tensors; linear_rows
    (orca_mq/engine/gemm.py), float32; sample_rows (orca_mq/engine/sampler.py); process_rows
    (orca_mq/engine/history.py)."""
    from torch.utils.cpp_extension import _get_build_directory, load_inline

    try:
        import ninja  # the PyPI build tool: its binary may not be on PATH (no shim, a venv not activated)

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass  # a system ninja may still be on PATH
    try:
        source = source_text()
        name = _build_name(source)
        build_dir = Path(_get_build_directory(name, verbose=False))
        # torch's own lock is a plain file that a builder killed mid-build leaves behind, and every later
        # process would wait on it forever; builders here serialize on flock, which dies with its holder,
        # so whoever holds it may remove a leftover file lock
        with open(build_dir.parent / f".{name}.flock", "w") as baton:
            fcntl.flock(baton, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            if not (build_dir / f"{name}.so").exists():
                print(f"orca-mq: building the CPU kernels for this CPU and environment (once, 20-40 s; cached in "
                      f"{build_dir})", file=sys.stderr, flush=True)
            module = load_inline(name=name, cpp_sources=[source], extra_cflags=CFLAGS,
                                 extra_ldflags=LDFLAGS, no_implicit_headers=True, verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure means: use the torch path
        logging.getLogger(__name__).warning("CPU kernels unavailable, using torch's ops (gather + SDPA): %s", e)
        return None
    return module


def source_text() -> str:
    return "\n".join(p.read_text() for p in SOURCES)
