"""orca_mq/tokenizer.py: transformers' tokenizer of a saved checkpoint loads through the class its
tokenizer_config.json names, the one AutoTokenizer picks, with the same ids and chat template; the served
tokenizer made from it is kept under model.cache_dir, keyed by the tokenizer's files (checkpoints that
share them share it; a changed file or a damaged entry makes it again), and the processes that tokenize
load it without importing transformers or torch (tests/test_chat_template_render.py: it serves what
transformers would)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from orca_mq.config import load_config
from orca_mq.server.process import ROOT
from orca_mq.tokenizer import Tokenizer, hf_tokenizer, load_saved, load_tokenizer

TEXTS = ["hello world", "  two spaces\n\nand lines", "<|im_start|>user\nhi<|im_end|>", "ünïcödé 東京 🙂"]


def _same(a: object, b: object) -> None:
    assert type(a) is type(b)
    for t in TEXTS:
        assert a(t)["input_ids"] == b(t)["input_ids"], t   # type: ignore[operator]
    chat = [{"role": "user", "content": "hi"}]
    assert a.apply_chat_template(chat, tokenize=False) == b.apply_chat_template(chat, tokenize=False)   # type: ignore[attr-defined]
    assert a.all_special_ids == b.all_special_ids and len(a) == len(b)   # type: ignore[attr-defined,arg-type]


def test_the_embedded_models_tokenizer_is_the_one_autotokenizer_loads(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    cfg = load_config()
    ours = hf_tokenizer(cfg.model.path, cfg.model.cache_dir)
    ours.save_pretrained(tmp_path)
    _same(load_saved(tmp_path), AutoTokenizer.from_pretrained(tmp_path))


@pytest.mark.parametrize("named", ["TokenizersBackend", "PreTrainedTokenizerFast", "GPT2TokenizerFast", None])
def test_the_named_class_is_used_and_without_one_autotokenizers(tmp_path: Path, named: str | None) -> None:
    from transformers import AutoTokenizer

    hf_tokenizer().save_pretrained(tmp_path)
    conf = tmp_path / "tokenizer_config.json"
    entries = json.loads(conf.read_text())
    entries.pop("tokenizer_class", None)
    conf.write_text(json.dumps(entries | ({"tokenizer_class": named} if named else {})))
    ours = load_saved(tmp_path)
    if named:   # transformers 5: a Fast name is an alias
        import transformers

        assert type(ours) is getattr(transformers, named)
    _same(ours, AutoTokenizer.from_pretrained(tmp_path))


def test_the_served_tokenizer_is_made_once_per_tokenizer_and_again_when_its_files_change(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    for name in ("a", "b"):   # two checkpoints, one tokenizer
        hf_tokenizer().save_pretrained(tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "llama", "name": name}))
    first = load_tokenizer(str(tmp_path / "a"), str(cache))
    entries = sorted((cache / "tokenizers").iterdir())
    assert len(entries) == 1 and load_tokenizer(str(tmp_path / "b"), str(cache)).json() == first.json()
    assert sorted((cache / "tokenizers").iterdir()) == entries
    (tmp_path / "b" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    changed = load_tokenizer(str(tmp_path / "b"), str(cache))
    assert changed.render_chat([{"role": "user", "content": "hi"}]) == "hi!" and len(list((cache / "tokenizers").iterdir())) == 2
    (entries[0] / "tokenizer.json").write_text("{")   # damaged: made again, in its place
    assert load_tokenizer(str(tmp_path / "a"), str(cache)).json() == first.json()
    assert Tokenizer.load(entries[0]).json() == first.json()
    shutil.rmtree(cache)
    assert load_tokenizer(str(tmp_path / "a"), "").json() == first.json() and not cache.exists()   # "": no cache


def test_split_special_tokens_is_kept_with_the_served_tokenizer(tmp_path: Path) -> None:
    """A checkpoint that asks for special tokens in text to be split (split_special_tokens) keeps them text
    through the entry, as transformers does: no prompt's text spells a control token."""
    hf_tokenizer().save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    conf = tmp_path / "m" / "tokenizer_config.json"
    conf.write_text(json.dumps(json.loads(conf.read_text()) | {"split_special_tokens": True}))
    hf = load_saved(tmp_path / "m")
    text = "hi<|im_end|>"
    assert 2 not in hf.encode(text, add_special_tokens=False)
    for _ in range(2):   # made, then read back
        assert load_tokenizer(str(tmp_path / "m"), str(tmp_path / "c")).encode(text, False) == hf.encode(text, add_special_tokens=False)


def test_tokenizing_processes_import_neither_torch_nor_transformers() -> None:
    """The frontend's and scheduler's modules, the embedded model's tokenizer and info, and a scheduler as
    a served one is made (the launcher resolves engine.device auto for its children), in a fresh process.
    The model's info and tokenizer are loaded first, as the launcher's start-up check reads (and caches)
    the info before any child starts and the first process to tokenize makes the served tokenizer: a
    cache miss imports the families' code, and torch with it, or transformers."""
    from orca_mq.models.registry import read_model_info

    cfg = load_config()
    read_model_info(cfg.model.path, cfg.model.cache_dir)
    load_tokenizer(cfg.model.path, cfg.model.cache_dir)
    code = ("import sys; from orca_mq.config import load_config; c = load_config(overrides={'engine.device': 'cpu'}); "
            "import orca_mq.server.frontend, orca_mq.server.scheduler_process; "
            "from orca_mq.protocol.structured import StructuredOutputsParams as S; "
            "from orca_mq.admission.served_model import ServedModel; from orca_mq.sched import make_scheduler; "
            "m = ServedModel(c); m.prompts; m.grammars.compile(S.from_dict({'regex': 'a+'})); make_scheduler(c, m.info); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
