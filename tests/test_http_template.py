"""vLLM's `chat_template_kwargs` and `skip_special_tokens`: the bounds of the template's variables, the
wire (protocol 6, older frames without them), the detokenizer leaving out the EOS that ends a request;
then through the official `openai` client against a real server whose model's chat template reads two
variables of its own (the prompt's tokens are the template's, rendered with them, exactly), and special
tokens forced by logit_bias that show in the text only with skip_special_tokens false; the offline LLM
the same, and its start-up lines on stderr."""
from __future__ import annotations

import inspect

import httpx
import openai
import pytest
from transformers import PreTrainedTokenizerBase

from orca_mq import LLM
from orca_mq.admission.prompts import MAX_TEMPLATE_KWARGS_CHARS, TEMPLATE_ARGUMENTS, check_template_kwargs
from orca_mq.bench.random_models import random_llama
from orca_mq.client import Client
from orca_mq.detokenizer import IncrementalDetokenizer, ends_on_eos
from orca_mq.errors import InvalidRequest
from orca_mq.protocol import decode, encode
from orca_mq.protocol.client_msgs import TO_SERVER, Generate
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.tokenizer import hf_tokenizer, load_tokenizer
from serving_harness import free_port, openai_client, start_server

TEMPLATE = ("{% if greeting is defined %}{{ greeting }}\n{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
CHAT = [{"role": "user", "content": "Hi there"}]
START, EOS = 1, 2          # the embedded tokenizer's <|im_start|> and <|im_end|> (its EOS)
KWARGS = ({}, {"greeting": "Bonjour tout le monde"}, {"enable_thinking": False})


def expected_ids(tok: PreTrainedTokenizerBase, **kwargs: object) -> list[int]:
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, **kwargs)
    return tok(text, add_special_tokens=False).input_ids


def test_template_kwargs_bounds():
    check_template_kwargs({"enable_thinking": False, "greeting": "x" * 100, "nested": {"a": [1, 2.5, None]}})
    for bad, words in (([1], "an object"), ({"messages": [], "tools": []}, "'messages', 'tools'"),
                       ({"add_generation_prompt": False}, "'add_generation_prompt'"), ({"raw": b"\x00"}, "JSON values"),
                       ({"x": "a" * MAX_TEMPLATE_KWARGS_CHARS}, f"at most {MAX_TEMPLATE_KWARGS_CHARS}")):
        with pytest.raises(InvalidRequest, match=words):
            check_template_kwargs(bad)
    # every parameter of transformers' apply_chat_template is one the kwargs may not replace
    params = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"}
    assert params <= TEMPLATE_ARGUMENTS


def test_protocol_6_carries_template_kwargs_and_older_frames_go_without():
    msg = Generate("r", messages=CHAT, chat_template_kwargs={"enable_thinking": False})
    assert decode(encode(msg), TO_SERVER).chat_template_kwargs == {"enable_thinking": False}
    assert decode(encode(msg, 5), TO_SERVER).chat_template_kwargs is None


def test_detokenizer_leaves_out_the_eos_that_ends_a_request():
    tok = load_tokenizer()
    ids = tok.encode("Hi there", False) + [START, EOS]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        text = detok.step(ids, hide_last=ends_on_eos(ids, "stop", {EOS})) + detok.finish()
        assert text == hf_tokenizer().decode(ids[:-1], skip_special_tokens=skip) and detok.ids == ids
    assert not ends_on_eos(ids, "length", {EOS}) and not ends_on_eos(ids[:-1], "stop", {EOS})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama with the embedded tokenizer, and a chat template that reads `greeting` and `enable_thinking`."""
    path = random_llama(tmp_path_factory.mktemp("template_model"), layers=2, max_positions=256)
    tok = hf_tokenizer(str(path))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    assert load_tokenizer(str(path)).chat_template == TEMPLATE
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir):
    port = free_port()
    srv = start_server(tmp_path_factory.mktemp("http_template"), **{
        "model.path": str(model_dir), "server.http_address": f"127.0.0.1:{port}", "model.max_model_len": 256})
    client = openai_client(f"http://127.0.0.1:{port}")
    yield srv, client, client.models.list().data[0].id, hf_tokenizer(str(model_dir)), f"http://127.0.0.1:{port}"
    client.close()
    assert srv.stop() == 0, srv.stderr()[-3000:]


@pytest.mark.e2e
def test_template_kwargs_reach_the_template(served):
    srv, oai, model, tok, base = served
    counts = set()
    for kwargs in KWARGS:
        want = expected_ids(tok, **kwargs)
        got = oai.chat.completions.create(model=model, messages=CHAT, max_tokens=1,
                                          extra_body={"chat_template_kwargs": kwargs})
        assert got.usage.prompt_tokens == len(want)
        tokens = httpx.post(f"{base}/tokenize", json={"messages": CHAT, "chat_template_kwargs": kwargs},
                            timeout=120).json()["tokens"]   # the first call loads the API process' tokenizer
        assert tokens == want
        counts.add(len(want))
    assert len(counts) == len(KWARGS)   # each variable changed the prompt
    with Client(srv.address) as zmq:
        out = zmq.generate(messages=CHAT, chat_template_kwargs=KWARGS[1], max_tokens=1)
        assert out.metrics["prompt_tokens"] == len(expected_ids(tok, **KWARGS[1]))
        refused = zmq.generate(prompt="Hi", chat_template_kwargs=KWARGS[1], max_tokens=1)
        assert refused.code == "invalid_request" and "needs messages or chat=True" in refused.error


@pytest.mark.e2e
def test_template_kwargs_out_of_bounds_are_400_naming_them(served):
    _, oai, model, _, _ = served
    for kwargs, words in (({"messages": []}, "'messages'"), ({"add_generation_prompt": False}, "'add_generation_prompt'"),
                          ({"x": "a" * MAX_TEMPLATE_KWARGS_CHARS}, "characters as JSON"), ([1], "an object")):
        with pytest.raises(openai.BadRequestError, match=words) as e:
            oai.chat.completions.create(model=model, messages=CHAT, max_tokens=1, extra_body={"chat_template_kwargs": kwargs})
        assert e.value.param == "chat_template_kwargs", e.value.body
    with pytest.raises(openai.BadRequestError, match="unknown parameter 'chat_template_kwargs'"):
        oai.completions.create(model=model, prompt="Hi", max_tokens=1, extra_body={"chat_template_kwargs": {}})


@pytest.mark.e2e
def test_skip_special_tokens_keeps_or_drops_forced_special_tokens(served):
    _, oai, model, tok, _ = served
    for forced, extra in ((START, {}), (EOS, {"ignore_eos": True})):   # a special token, and an EOS that does not stop
        want = tok.decode([forced] * 3, skip_special_tokens=False)
        for skip, text in ((None, ""), (True, ""), (False, want)):
            body = extra | ({} if skip is None else {"skip_special_tokens": skip})
            out = oai.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0,
                                         logit_bias={str(forced): 100}, extra_body=body)
            assert (out.choices[0].text, out.usage.completion_tokens) == (text, 3)
            stream = oai.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0, stream=True,
                                                 logit_bias={str(forced): 100}, extra_body=body)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    # the EOS that ends a request is not its text, kept special tokens or not (as vLLM)
    out = oai.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0, logit_bias={str(EOS): 100},
                                      extra_body={"skip_special_tokens": False})
    assert (out.choices[0].message.content, out.choices[0].finish_reason, out.usage.completion_tokens) == ("", "stop", 1)
    with pytest.raises(openai.BadRequestError, match="skip_special_tokens"):
        oai.completions.create(model=model, prompt="Hi", max_tokens=1, extra_body={"skip_special_tokens": "no"})


def test_llm_offline_start_lines_special_tokens_and_template_kwargs(model_dir, capfd):
    llm = LLM(model=str(model_dir), dtype="float32", max_bs=2, n_slots=1024)
    lines = [line.split("LLM: ", 1)[1] for line in capfd.readouterr().err.splitlines() if "LLM: " in line]
    assert [line.split()[0] for line in lines] == ["loading", "model", "ready"], lines
    assert model_dir.name in lines[0] and " s (float32 on cpu)" in lines[1] and lines[2].endswith(" s")
    shown = [llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0, logit_bias={START: 100},
                                                  skip_special_tokens=skip))[0].text for skip in (True, False)]
    assert shown == ["", "<|im_start|><|im_start|>"]
    ended = llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0, logit_bias={EOS: 100}, skip_special_tokens=False))
    assert (ended[0].text, ended[0].token_ids, ended[0].finish_reason) == ("", [EOS], "stop")
    chat = llm.chat(CHAT, SamplingParams(max_tokens=1), chat_template_kwargs=KWARGS[1])
    assert chat[0].prompt_token_ids == expected_ids(hf_tokenizer(str(model_dir)), **KWARGS[1])
    with pytest.raises(InvalidRequest, match="'tools'"):
        llm.chat(CHAT, chat_template_kwargs={"tools": []})
    LLM(model=str(model_dir), dtype="float32", max_bs=2, n_slots=1024, progress=False)
    assert "LLM: " not in capfd.readouterr().err
