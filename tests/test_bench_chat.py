"""Issue 22's chat-shaped traces: the generator's shapes (shared system prompts, Zipf popularity,
multi-turn dependencies, seeds), the closed loop's prompts (turn k+1 = turn k's prompt + its
answer + a new user message, token for token under the model's chat template), and a real server
reporting cached prompt tokens from turn 2 on is in test_http_api (its server)."""
from __future__ import annotations

import asyncio
import math
from collections import Counter

import numpy as np
import pytest

from orca_mq.bench.trace import TraceSpec, chat_stats, make_chat_trace, make_trace, zipf_pmf

CORPUS = list(range(1000, 6000))   # stand-in for tokenized text, as in test_bench_trace


def decode(ids: list[int]) -> str:
    """Stand-in for a tokenizer: one word per id, so text equality is token-id equality."""
    return " ".join(f"t{i}" for i in ids)


def encode(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def spec(**kw) -> TraceSpec:
    return TraceSpec(**{"kind": "chat", "num_requests": 48, "rate": 0.0, "input_len": (24, 96),
                        "output_len": (16, 64), "system_prompts": 4, "system_len": 448, "seed": 5, **kw})


def test_chat_requests_share_system_prompts_token_for_token():
    trace = make_chat_trace(spec(), CORPUS, decode)
    assert len(trace) == 48 and [t.index for t in trace] == list(range(48))
    systems: dict[int, list[int]] = {}
    users = []
    for t in trace:
        (sys_msg, user), = [t.messages]
        assert (sys_msg["role"], user["role"], t.turn, t.delay_s) == ("system", "user", 0, 0.0)
        ids = encode(sys_msg["content"])
        assert len(ids) == 448 and systems.setdefault(t.system, ids) == ids   # one prompt per index, exactly
        users.append(encode(user["content"]))
        assert 24 <= len(users[-1]) <= 96 and 16 <= t.max_tokens <= 64
    assert len(systems) == 4 and len({tuple(v) for v in systems.values()}) == 4
    assert len({tuple(u) for u in users}) == 48                     # every user turn its own
    assert not {w for u in users for w in u} & {w for s in systems.values() for w in s}
    assert sum(chat_stats(trace)["system_prompt_uses"]) == 48


def test_system_prompt_popularity_is_zipf():
    trace = make_chat_trace(spec(num_requests=20000, system_len=4, input_len=(1, 1), zipf=1.2), CORPUS, decode)
    counts = Counter(t.system for t in trace)
    freq = np.array([counts[i] for i in range(4)]) / 20000
    np.testing.assert_allclose(freq, zipf_pmf(0, 3, 1.2), atol=0.015)    # ~4.5 sigma of a binomial at 20000
    assert list(freq) == sorted(freq, reverse=True)
    flat = Counter(t.system for t in make_chat_trace(spec(num_requests=20000, system_len=4, input_len=(1, 1), zipf=0.0),
                                                     CORPUS, decode))
    np.testing.assert_allclose([flat[i] / 20000 for i in range(4)], 0.25, atol=0.015)


def test_multiturn_shape():
    s = spec(kind="multiturn", num_requests=5, turns=3, think_s=0.5, rate=2.0, system_prompts=2, system_len=32)
    trace = make_chat_trace(s, CORPUS, decode)
    assert [(t.conversation, t.turn) for t in trace] == [(c, k) for c in range(5) for k in range(3)]
    starts = [t.delay_s for t in trace if t.turn == 0]
    assert starts[0] == 0.0 and starts == sorted(starts) and starts[-1] > 0
    for t in trace:
        roles = [m["role"] for m in t.messages]
        assert roles == (["system", "user"] if t.turn == 0 else ["user"])
        assert (t.system is None) == (t.turn > 0)
        if t.turn:
            assert t.delay_s == 0.5
    none = make_chat_trace(spec(kind="multiturn", num_requests=3, turns=2, system_prompts=0), CORPUS, decode)
    assert all([m["role"] for m in t.messages] == ["user"] for t in none)


def test_chat_seeds_reproduce_and_rate_only_moves_starts():
    s = spec(kind="multiturn", num_requests=6, turns=3, rate=1.0)
    a, b = make_chat_trace(s, CORPUS, decode), make_chat_trace(s, CORPUS, decode)
    assert a == b
    c = make_chat_trace(spec(kind="multiturn", num_requests=6, turns=3, rate=1.0, seed=6), CORPUS, decode)
    assert [t.messages for t in a] != [t.messages for t in c]
    fast = make_chat_trace(spec(kind="multiturn", num_requests=6, turns=3, rate=4.0), CORPUS, decode)
    assert [(t.messages, t.max_tokens) for t in fast] == [(t.messages, t.max_tokens) for t in a]
    np.testing.assert_allclose([t.delay_s * 4 for t in fast if t.turn == 0], [t.delay_s for t in a if t.turn == 0])


def test_chat_kinds_are_checked():
    with pytest.raises(ValueError, match="make_chat_trace"):
        make_trace(spec(), CORPUS)
    with pytest.raises(ValueError, match="make_trace"):
        make_chat_trace(TraceSpec(kind="orca"), CORPUS, decode)
    for bad in (dict(system_prompts=-1), dict(system_len=0), dict(turns=0), dict(think_s=-1.0),
                dict(think_s=math.inf)):
        with pytest.raises(ValueError):
            spec(**bad).validate()


def test_closed_loop_sends_each_turn_with_the_conversation_so_far(tiny_served_dir):
    """Turn k+1 goes out after turn k's answer, as turn k's messages + the answer + a new user message;
    under the model's chat template its token ids start with turn k's prompt + the answer's."""
    from orca_mq.bench.replay import closed_loop
    from orca_mq.admission.prompts import Prompts
    from orca_mq.tokenizer import load_tokenizer

    tok = load_tokenizer(str(tiny_served_dir))   # the embedded model's tokenizer and chat template
    chat = Prompts.for_model(tok, 2048).encode_chat   # the template as the server applies it
    trace = make_chat_trace(spec(kind="multiturn", num_requests=3, turns=3, system_prompts=2, system_len=40,
                                 input_len=(5, 12), output_len=(3, 6)), list(range(1000, 20000)), tok.decode)
    sent: list[tuple[dict, list[dict[str, str]], str]] = []
    now = [0.0]

    async def send(rec, prompt, text):
        assert all(r["conversation"] != rec["conversation"] or r["finish_s"] <= now[0] for r, _, _ in sent)
        answer = f" answer {rec['conversation']}.{rec['turn']} of {rec['max_tokens']} tokens"
        text.append(answer)
        now[0] += 1.0
        rec.update(arrival_s=now[0] - 1.0, finish_s=now[0])
        sent.append((rec, prompt["messages"], answer))
        return rec

    records = asyncio.run(closed_loop(trace, send, lambda: now[0]))
    assert sorted(r["index"] for r in records) == list(range(9))
    by_turn = {(r["conversation"], r["turn"]): (msgs, answer) for r, msgs, answer in sent}
    for (c, k), (msgs, answer) in by_turn.items():
        assert msgs[-1] == trace[c * 3 + k].messages[-1]
        if k == 0:
            continue
        prev, prev_answer = by_turn[(c, k - 1)]
        assert msgs == prev + [{"role": "assistant", "content": prev_answer}] + trace[c * 3 + k].messages
        ids = chat(msgs)
        head = chat(prev) + tok.encode(prev_answer, add_special_tokens=False)
        assert ids[:len(head)] == head


def test_a_failed_turn_ends_its_conversation():
    from orca_mq.bench.replay import closed_loop

    trace = make_chat_trace(spec(kind="multiturn", num_requests=2, turns=3, system_len=8), CORPUS, decode)

    async def send(rec, prompt, text):
        rec.update(arrival_s=0.0, finish_s=0.0, error="boom" if rec["conversation"] == 1 and rec["turn"] == 1 else None)
        return rec

    records = sorted(asyncio.run(closed_loop(trace, send, lambda: 0.0)), key=lambda r: r["index"])
    assert [r["error"] for r in records] == [None, None, None, None, "boom", "not sent: turn 1 failed"]


@pytest.mark.e2e
def test_multiturn_replay_reports_cached_tokens(tmp_path, tiny_served_dir):
    """A real server (a tiny model with the embedded tokenizer and chat template): a multi-turn trace
    replayed over the ZeroMQ client and over HTTP; from turn 2 on, each prompt's full blocks of the
    previous turn's prompt come from the prefix cache, as the final message and the usage report."""
    from orca_mq.bench.metrics import summarize
    from orca_mq.bench.openai_backend import OpenAIClient
    from orca_mq.bench.replay import open_client, replay
    from orca_mq.tokenizer import load_tokenizer
    from serving_harness import free_port, start_server

    tok = load_tokenizer(str(tiny_served_dir))
    port = free_port()
    srv = start_server(tmp_path, **{"model.path": str(tiny_served_dir), "server.http_address": f"127.0.0.1:{port}",
                                    "model.max_model_len": 256})
    try:
        for seed, (target, factory) in enumerate(((srv.address, open_client),
                                                  (f"http://127.0.0.1:{port}", OpenAIClient))):
            trace = make_chat_trace(spec(kind="multiturn", num_requests=3, turns=3, system_prompts=2, system_len=24,
                                         input_len=(8, 16), output_len=(4, 8), seed=seed),
                                    list(range(1000, 20000)), tok.decode)
            records, _ = asyncio.run(replay(target, trace, progress=False, client_factory=factory))
            assert summarize(records)["n_ok"] == 9, [r["error"] for r in records]
            prompt = {(r["conversation"], r["turn"]): r["prompt_tokens"] for r in records}
            for r in records:
                assert r["generated_tokens"] == r["max_tokens"]
                if r["turn"]:
                    before = prompt[(r["conversation"], r["turn"] - 1)]
                    assert r["prompt_tokens"] > before + r["max_tokens"]
                    assert r["cached_tokens"] >= (before - 1) // 16 * 16 > 0, (target, r)
            assert summarize(records)["total_cached_tokens"] == sum(r["cached_tokens"] for r in records)
    finally:
        assert srv.stop() == 0, srv.stderr()[-3000:]
