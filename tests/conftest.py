"""Shared fixtures: tiny random Llama / GPT-2 models saved as safetensors dirs, and the embedded model;
and the suite's own check that it wrote nothing into the checkout (issue 43: a test's refused launch
left logs/5555/launcher.log there, which `orca-mq logs` then showed as the last server's): every test
writes under a temporary directory only, or the session fails naming what it wrote."""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from orca_mq.bench.random_models import family_config, random_llama, save_byte_tokenizer, save_random_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
CACHES = frozenset({".git", "__pycache__", ".pytest_cache", ".hypothesis"})   # the tools' own, git-ignored
_BEFORE: set[str] = set()


def checkout_paths(root: Path = ROOT) -> set[str]:
    """Every file and folder of the checkout but git's, the caches and a virtual environment's."""
    found: set[str] = set()
    for top, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in CACHES and not os.path.exists(os.path.join(top, d, "pyvenv.cfg"))]
        rel = os.path.relpath(top, root)
        found.update(os.path.normpath(os.path.join(rel, name)) for name in dirs + [f for f in files if not f.endswith(".pyc")])
    return found


def pytest_sessionstart(session: pytest.Session) -> None:
    _BEFORE.update(checkout_paths())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    written = sorted(checkout_paths() - _BEFORE)
    if written:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        report = session.config.pluginmanager.get_plugin("terminalreporter")
        report.ensure_newline()
        report.write_sep("=", f"FAILED: the suite wrote {len(written)} paths into the checkout {ROOT} "
                              "(tests write under a temporary directory only)", red=True)
        for path in written[:20]:
            report.write_line(f"  {path}")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    return save_random_model(tmp_path_factory.mktemp("tiny_llama"), cfg)


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory) -> Path:
    from transformers import GPT2Config

    cfg = GPT2Config(vocab_size=512, n_embd=64, n_layer=3, n_head=4, n_positions=512,
                     bos_token_id=1, eos_token_id=2)
    return save_random_model(tmp_path_factory.mktemp("tiny_gpt2"), cfg)


@pytest.fixture(scope="session")
def hf_reference():
    """transformers' own model for the embedded GGUF (the reference tests compare against)."""
    from transformers import AutoModelForCausalLM

    from orca_mq.models.files import embedded_model_path

    path = embedded_model_path()
    with _gguf_parsed_once():
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers reads a GGUF with gguf's reader twice (its config, then its tensors) and builds gguf's
    tensor-name map once per tensor: half of the 28 s the embedded model's reference takes here. Both made
    once while it loads (the same reader and map; its weights are the same tensors either way)."""
    import gguf

    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(reader)   # transformers imports both from gguf at each call
    gguf.get_tensor_name_map = functools.cache(names)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, names


@pytest.fixture(scope="session")
def embedded_llm():
    from orca_mq import LLM

    return LLM(max_bs=3, n_slots=4096, dtype="float32")   # exact: judged in fp32


def _served_model(path: Path, near_ties: bool) -> Path:
    return random_llama(path, layers=2, max_positions=256, near_ties=near_ties)


@pytest.fixture(scope="session")
def tiny_served_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with the embedded model's tokenizer and chat template: a real server that
    starts in seconds and answers a request in milliseconds (input-handling tests, fuzzing)."""
    return _served_model(tmp_path_factory.mktemp("tiny_served"), near_ties=False)


@pytest.fixture(scope="session")
def tiny_near_tie_dir(tmp_path_factory) -> Path:
    """tiny_served_dir's shape with its top logits in near-tied pairs: greedy tokens flip with
    rounding, so a test sees any change of a request's logits (engine.deterministic)."""
    return _served_model(tmp_path_factory.mktemp("tiny_near_tie"), near_ties=True)


@pytest.fixture(scope="session")
def family_servers(tmp_path_factory):
    """Real servers of the model families' tiny checkpoints (tests/agent_harness.py), one alive at a time,
    shared by the agent tests' modules."""
    from agent_harness import FamilyServers

    servers = FamilyServers(tmp_path_factory)
    yield servers
    servers.close()


EMBEDDING_FAMILIES = ("qwen3", "gemma2")


@pytest.fixture(scope="session")
def embedding_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Tiny random checkpoints of two families (qwen3; gemma2: its embedding scale and soft-caps) for the
    embedding tests, offline and served."""
    root = tmp_path_factory.mktemp("embed_families")
    return {name: save_byte_tokenizer(save_random_model(root / name, family_config(name))) for name in EMBEDDING_FAMILIES}


@pytest.fixture(scope="session")
def embedding_references(embedding_checkpoints) -> dict[str, torch.nn.Module]:
    """Each one's transformers base model (the CausalLM's `model`: last_hidden_state is the final norm's output)."""
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().model
            for name, path in embedding_checkpoints.items()}
