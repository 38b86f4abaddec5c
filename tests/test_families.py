"""Every family is exact against transformers in fp32 (issue 40): a tiny random checkpoint of each, built
from transformers' own config class and saved with save_pretrained (orca_mq/bench/random_models.py), with
prompts longer than every window: a mixed iteration's logits on the torch and cpu attention paths; greedy
tokens and their log probabilities through the offline LLM, batched with joins and leaves; tensor
parallelism over real worker processes."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from orca_mq import LLM, SamplingParams
from orca_mq.bench.plans import mixed_iteration_logits
from orca_mq.bench.random_models import FAMILIES, LENGTH_ROPES, family_config, save_byte_tokenizer, save_random_model
from orca_mq.config import load_config
from orca_mq.engine.model_runner import ModelRunner
from workers.local_grid import run_grid

TOL = 1e-4   # fp32 logits: rounding of sums over a few hundred terms, far below this
PROMPTS = (20, 33, 17, 45, 26)   # past the window of 16
STEPS = (12, 5, 20, 8, 15)       # each leaves at its own time; max_bs 3 of 5: later ones join


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: save_byte_tokenizer(save_random_model(root / name, family_config(name))) for name in FAMILIES + LENGTH_ROPES}


def _cfg(path: Path, backend: str = "torch", **more: object):
    return load_config(overrides={"model.path": str(path), "engine.block_size": 8, "engine.n_slots": 4096,
                                  "engine.threads_per_worker": 1, "engine.attention_backend": backend,
                                  "model.dtype": "float32"} | more)


def _reference(path: Path) -> torch.nn.Module:
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None   # greedy to max_new_tokens, as ignore_eos does
    return ref


def _prompts(seed: int, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPTS]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("family", FAMILIES + LENGTH_ROPES)
def test_mixed_iteration_equals_transformers(family, backend, checkpoints):
    """Whole prompts beside decode steps whose prefix an earlier iteration cached; transformers computes the
    same: a prompt in one forward, a decode step on its cache (a length-dependent rotary's keys are those
    of the length they were computed at, in transformers' cache as in the paged KV)."""
    runner = ModelRunner(_cfg(checkpoints[family], backend, **{"model.max_model_len": 512}))
    rng = random.Random(1)
    prefills = [[rng.randrange(256) for _ in range(n)] for n in (1, 7, 33, 70)]
    decodes = [[rng.randrange(256) for _ in range(n)] for n in (2, 9, 17, 40)]
    ours = mixed_iteration_logits(runner, prefills, decodes, rng)
    ref = _reference(checkpoints[family])
    with torch.no_grad():
        expected = [ref(torch.tensor([s])).logits[0, -1] for s in prefills]
        for s in decodes:
            cache = ref(torch.tensor([s[:-1]]), use_cache=True).past_key_values
            expected.append(ref(torch.tensor([s[-1:]]), past_key_values=cache).logits[0, -1])
    assert (ours - torch.stack(expected)).abs().max().item() <= TOL


@pytest.mark.parametrize("family", FAMILIES + LENGTH_ROPES)
def test_batched_greedy_tokens_and_logprobs_equal_transformers(family, checkpoints):
    """Five requests through max_bs 3 (joins and leaves), chunked prompts (whole ones for a length-dependent
    rotary, as transformers computes a prompt) and the prefix cache on: each one's greedy tokens are
    transformers' generate of it alone, its log probabilities within TOL."""
    llm = LLM(model=str(checkpoints[family]), max_bs=3, n_slots=4096, block_size=8, dtype="float32",
              max_num_batched_tokens=0 if family in LENGTH_ROPES else 24, max_model_len=512, progress=False)
    prompts = _prompts(7)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1)
                                  for n in STEPS])
    ref = _reference(checkpoints[family])
    for prompt, n, out in zip(prompts, STEPS, outs):
        tokens, logprobs = _greedy(ref, prompt, n)
        assert out.token_ids == tokens
        assert max(abs(a - b) for a, b in zip(out.logprobs.logprobs, logprobs)) <= TOL


@torch.no_grad()
def _greedy(ref: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy decoding on its own cache, a token per forward: the tokens and their log
    probabilities. (generate() is the same but for a length-dependent rotary, where at the step that
    crosses the original length it departs from the model's cached forward: not what a cache computes.)"""
    out = ref(torch.tensor([prompt]), use_cache=True)
    tokens, logprobs = [], []
    for _ in range(n):
        lp = torch.log_softmax(out.logits[0, -1].float(), -1)
        tokens.append(int(lp.argmax()))
        logprobs.append(lp[tokens[-1]].item())
        out = ref(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs


TP_FAMILIES = ("qwen3", "gemma2", "phi3", "mixtral", "gpt_oss")


def _families_job(step, runner, jobs):  # type: ignore[no-untyped-def]
    """Each family's plans on this rank's shard (one grid of processes for them all: one spawn)."""
    from orca_mq.config import Config

    out = []
    for cfg, plans in jobs:
        shard = ModelRunner(Config.from_dict(cfg), tp=runner.tp.where)
        out.append([shard.forward(p) for p in plans][-1].numpy())
    return out


@pytest.fixture(scope="module")
def tp2(checkpoints):
    """(each TP family's single-process logits, its two ranks' logits)."""
    from tests.test_tensor_parallel import _mixed_plans

    jobs, expected = [], []
    for family in TP_FAMILIES:
        cfg = _cfg(checkpoints[family])
        single = ModelRunner(cfg)
        plans, _ = _mixed_plans(single.info.vocab_size, single.kv.num_blocks, single.block_size, seed=3)
        expected.append([single.forward(p) for p in plans][-1])
        jobs.append((cfg.to_dict(), plans))
    got = run_grid(1, 2, _cfg(checkpoints[TP_FAMILIES[0]]), _families_job, jobs)
    return dict(zip(TP_FAMILIES, zip(expected, got)))


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tp2_equals_one_process(family, tp2):
    """Two tensor-parallel ranks over gloo (each expert's width split for the mixtures; q/k norms, sinks,
    soft-caps, partial rotary and fused checkpoint tensors sharded) give the single process's logits."""
    expected, got = tp2[family]
    assert (torch.from_numpy(got) - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("mode", ["plain", "speculative", "fastserve"])
def test_sliding_window_holds_a_window_and_stays_exact(mode, checkpoints):
    """Every layer of the tiny Mistral slides (window 16): generating 4x the window, a request holds at
    most window / block_size + 2 blocks, and its greedy tokens stay transformers' through the prefix
    cache (the same prompt twice), speculative verify rows and FastServe's scheduler."""
    more = {"speculative": dict(speculative__method="ngram", speculative__lookup_min=1),
            "fastserve": dict(scheduler__policy="fastserve")}.get(mode, {})
    llm = LLM(model=str(checkpoints["mistral"]), max_bs=4, n_slots=1024, block_size=4, dtype="float32",
              max_num_batched_tokens=8, progress=False, **more)
    bm, step = llm.scheduler.block_manager, llm.scheduler.step
    most = 0

    def watched(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal most
        most = max([most, *(bm.held(rid) for rid in llm.scheduler.pool)])
        return step(*args, **kwargs)

    llm.scheduler.step = watched   # type: ignore[method-assign]
    prompt = _prompts(11)[0]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    again = llm.generate([prompt + first.token_ids[:3]], params)[0]   # its prompt's blocks from the cache
    ref = _reference(checkpoints["mistral"])
    for p, out in ((prompt, first), (prompt + first.token_ids[:3], again)):
        assert out.token_ids == _greedy(ref, p, 64)[0]
    assert bm.hits > 0 and 0 < most <= 16 // 4 + 2
    assert bm.num_free_blocks == bm.num_blocks and bm.n_rsrv == 0


def test_a_checkpoint_that_cannot_be_served_is_one_line(checkpoints, tmp_path):
    """An architecture orca-mq does not have, a config without a key its family needs, tensors whose sizes
    disagree with the config: one line naming the file and what is wrong, from the launcher with status 1
    before any worker starts (the GGUF cases: tests/test_gguf_families.py)."""
    import json
    import shutil
    import subprocess
    import sys

    from orca_mq.models.registry import read_model_info
    from orca_mq.models.checked import check_checkpoint
    from orca_mq.server.process import free_port

    def variant(name: str, edit) -> Path:  # type: ignore[no-untyped-def]
        d = shutil.copytree(checkpoints["qwen3"], tmp_path / name)
        config = json.loads((d / "config.json").read_text())
        edit(config)
        (d / "config.json").write_text(json.dumps(config))
        return d

    unknown = variant("unknown", lambda c: c.update(model_type="rwkv", architectures=["RwkvForCausalLM"]))
    with pytest.raises(ValueError, match=r"unknown/config\.json: model_type 'rwkv' \(RwkvForCausalLM\) not supported"):
        read_model_info(str(unknown))
    keyless = variant("keyless", lambda c: c.pop("num_hidden_layers"))
    with pytest.raises(ValueError, match=r"keyless/config\.json lacks the key 'num_hidden_layers' \(model_type 'qwen3'\)"):
        read_model_info(str(keyless))
    wider = variant("wider", lambda c: c.update(intermediate_size=128))
    with pytest.raises(ValueError, match=r"wider: .*mlp\.gate_proj\.weight \+ .*up_proj\.weight has 12288 elements, but the "
                                         r"config implies gate_up of shape \(256, 64\)"):
        check_checkpoint(read_model_info(str(wider)))
    port = free_port()
    out = subprocess.run([sys.executable, "tools/launch.py", "--model", str(wider), "--port", str(port), "--set",
                          "server.http_address=", "--set", f"log.dir={tmp_path}/logs"], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert "orca-mq: model:" in out.stderr and "but the config implies gate_up" in out.stderr


def test_a_sound_checkpoint_is_checked_once_and_again_when_a_file_changes(checkpoints, tmp_path):
    """The launcher's check reads the files' headers without importing torch, and is remembered under
    model.cache_dir, keyed by every file of the directory: a weights file rewritten without a tensor is
    checked, and refused (as is a file that is not safetensors)."""
    import shutil
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    from orca_mq.models.checked import check_checkpoint
    from orca_mq.models.registry import read_model_info
    from orca_mq.server.process import ROOT

    d, cache = shutil.copytree(checkpoints["qwen3"], tmp_path / "qwen3"), tmp_path / "cache"
    info = read_model_info(str(d), str(cache))
    code = ("import sys; from orca_mq.models.registry import read_model_info; from orca_mq.models.checked import "
            f"check_checkpoint; check_checkpoint(read_model_info({str(d)!r}, {str(cache)!r}), {str(cache)!r}); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.split("\n")[-2] == "[]", out.stdout[-500:] + out.stderr[-2000:]
    assert len(list(cache.glob("checked-*"))) == 1
    check_checkpoint(info, str(cache))   # remembered: no second marker
    assert len(list(cache.glob("checked-*"))) == 1
    (weights,) = d.glob("*.safetensors")
    tensors = load_file(weights)
    dropped = next(k for k in tensors if k.endswith("mlp.down_proj.weight"))
    save_file({k: v for k, v in tensors.items() if k != dropped}, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"tensor {dropped} missing"):
        check_checkpoint(info, str(cache))
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-64])   # a download cut short: refused here, not in a worker
    with pytest.raises(ValueError, match="cut short"):
        check_checkpoint(info, str(cache))
    weights.write_bytes(b"\x10" + bytes(7) + b"{not json")
    with pytest.raises(ValueError, match="not a safetensors file"):
        check_checkpoint(info, str(cache))


def test_the_checkpoints_own_chat_template_and_every_end_of_turn_id(checkpoints, tmp_path):
    """A checkpoint's chat template (its chat_template.jinja: Qwen3's published one) renders its chat
    prompts, and every end-of-turn id it declares (generation_config.json's list) ends a request."""
    import json
    import shutil

    d = shutil.copytree(checkpoints["qwen3"], tmp_path / "qwen3")
    template = (Path(__file__).parent / "data" / "chat_templates" / "qwen3.jinja").read_text()
    (d / "chat_template.jinja").write_text(template)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9], "bos_token_id": 1}))
    llm = LLM(model=str(d), n_slots=1024, dtype="float32", progress=False)
    assert llm.info.eos_token_ids == [2, 9]
    messages = [{"role": "user", "content": "Hi"}]
    ids = llm.model.prompts.encode_chat(messages)
    assert llm.tokenizer.decode(ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    out = llm.chat(messages, SamplingParams(max_tokens=8, temperature=0, logit_bias={9: 100.0}))[0]
    assert out.token_ids == [9] and out.finish_reason == "stop"


def test_served_through_a_two_stage_pipeline(checkpoints, tmp_path):
    """gpt-oss (sinks, windowed and full layers, experts) served by real processes, its layers split over
    two pipeline stages: three requests at once get transformers' greedy tokens."""
    from concurrent.futures import ThreadPoolExecutor

    from orca_mq.client import Client
    from tests.serving_harness import start_server

    server = start_server(tmp_path, n_workers=2, **{"model.path": str(checkpoints["gpt_oss"]), "engine.n_slots": 2048})
    try:
        prompts = _prompts(5)[:3]
        with Client(server.address) as client, ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(lambda p: client.generate(prompt_token_ids=p, max_tokens=10, temperature=0,
                                                           ignore_eos=True), prompts))
        ref = _reference(checkpoints["gpt_oss"])
        for prompt, out in zip(prompts, outs):
            assert out.finish_reason == "length" and out.token_ids == _greedy(ref, prompt, 10)[0]
    finally:
        server.stop()


def test_a_checkpoints_info_is_cached_by_its_files_and_read_back_without_torch(checkpoints, tmp_path):
    """read_model_info's cache (what spares the launcher, the frontend and the scheduler transformers'
    config reading, which imports torch): every family's info reads back equal; another directory with
    the same config.json shares the entry, with its own path; an edited config.json misses it."""
    import json
    import subprocess
    import sys

    from orca_mq.models.registry import read_model_info
    from orca_mq.server.process import ROOT

    cache = tmp_path / "cache"
    for name, path in checkpoints.items():
        first = read_model_info(str(path), str(cache))
        assert read_model_info(str(path), str(cache)) == first == read_model_info(str(path)), name
    assert len(list(cache.glob("info3-*.json"))) == len(checkpoints)
    path = checkpoints[FAMILIES[0]]
    code = ("import sys; from orca_mq.models.registry import read_model_info; "
            f"i = read_model_info({str(path)!r}, {str(cache)!r}); print(i.n_layers, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.stdout.split() == [str(read_model_info(str(path)).n_layers), "False"], out.stderr[-2000:]
    edited = tmp_path / "edited"
    edited.mkdir()
    for f in path.iterdir():
        if f.name == "config.json":
            (edited / f.name).write_bytes(f.read_bytes())
        else:
            (edited / f.name).symlink_to(f)
    shared = read_model_info(str(edited), str(cache))
    assert shared.n_layers == read_model_info(str(path)).n_layers > 1 and shared.path == str(edited)
    assert len(list(cache.glob("info3-*.json"))) == len(checkpoints)
    raw = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps(raw | {"num_hidden_layers": 1}, indent=3))   # cached: read again
    assert read_model_info(str(edited), str(cache)).n_layers == 1
