"""The message codec: every type round-trips; malformed, truncated, unknown and wrong-version
frames and badly typed fields are rejected with a ProtocolError (never another exception)."""
from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orca_mq.protocol.iteration import IterationPlan, IterationResult, SeqWork, pack
from orca_mq.protocol.sampling import SamplingParams
from orca_mq.protocol.structured import StructuredOutputsParams
from orca_mq.protocol import PROTOCOL_VERSION, ProtocolError, decode, encode, unpack
from orca_mq.protocol.client_msgs import (TO_CLIENT, TO_SERVER, Abort, Final, Generate, Output, Outputs, Ping, Pong, Stats,
                                          StatsReply)
from orca_mq.protocol.common_msgs import Error
from orca_mq.protocol.codec import channel
from orca_mq.protocol.control_msgs import AbortAll, ClientGone, Drain, Drained, Fatal, Ready
from orca_mq.protocol.engine_msgs import (AbortRequest, AddRequest, ControlFrame, IterationDone, StatsQuery,
                                          StatsResult, TokenBatch, WorkerStats, WorkerStatsQuery)
from orca_mq.protocol.logprobs import Logprobs

PLAN = IterationPlan(7, [SeqWork("a", [1, 2, 3], 0, [0], 0.0, 0, 1.0, None),
                         SeqWork("b", [9], 41, [3, 4, 5], 0.7, 40, 0.9, 1234)], swap_out=[(1, 100)], swap_in=[(101, 2)])

MESSAGES = [
    Generate("r1", prompt="héllo 你好", sampling={"max_tokens": 4, "temperature": 0.0}),
    Generate("r2", prompt_token_ids=[1, 2, 3]),
    Generate("r3", messages=[{"role": "user", "content": "hi"}], chat=True),
    Abort("r1"), Stats("q", record=True), Ping(5),
    Output("r1", [5], "x"), Output("r1", [], "", True, "error", "bad", {"ttft": 0.1}), StatsReply("q", {"a": [1]}),
    Outputs(["r1", "r2", "r3"], [[5], [], [6, 7]], ["x", "", "yz"], [None, Final("abort", code="aborted"),
                                                                     Final("length", None, {"ttft": 0.1})]),
    Pong(5), Error("nope"), Error("nope", "r1"),
    AddRequest("#1", [1, 2], SamplingParams(max_tokens=3, temperature=0.5, seed=7, stop_token_ids=[2])), AbortRequest("r1"),
    AddRequest("#2", [1], SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))),
    TokenBatch(3, ["a", "c", "a"], [5, 6, 7], {"a": "length", "b": "abort"}, {"a": {"cached_tokens": 0}}),
    StatsQuery("q"), StatsResult("q", {}), ControlFrame(pack(PLAN), 1.5),
    IterationDone(IterationResult(7, [10, 11]), 1.0, 2.0), WorkerStatsQuery("q", True), WorkerStats("q", 1, {}),
    Ready("frontend", 12), Drain(), Drained(), AbortAll("why"), Fatal("worker1 died"), ClientGone(b"\x00abcd"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg), channel(type(msg))) == msg


def test_plan_keeps_its_types():
    plan = decode(encode(ControlFrame(pack(PLAN), 0.0)), channel(ControlFrame)).plan
    a = plan.arrays()
    assert plan.request_ids == ["a", "b"] and a.seeds.tolist() == [-1, 1234] and plan.num_tokens == 4
    assert a.tables.tolist() == [0, 3, 4, 5] and a.token_ids.tolist() == [1, 2, 3, 9] and a.top_k.tolist() == [0, 40]
    assert plan.swap_out == [(1, 100)] and isinstance(plan.swap_out[0], tuple)


@pytest.mark.parametrize("column,value,why", [
    ("q_lens", b"\x01\x00\x00\x00", "rows"), ("token_ids", b"\x01\x00\x00", "whole number"),
    ("tables", b"", "add up"), ("prev_rows", b"\x00\x00\x00\x00" * 2, "follow no earlier"),
    ("mask_rows", b"\x05\x00\x00\x00", "masks"),
])
def test_plan_columns_are_checked(column, value, why):
    """A frame's columns must agree with each other before the engine reads them (values are the engine's to check)."""
    plan = dataclasses.replace(pack(PLAN), **{column: value})
    with pytest.raises(ValueError, match=why):
        decode(encode(ControlFrame(plan, 0.0)), channel(ControlFrame)).plan.arrays()


def _raw(**body):
    return msgpack.packb({"v": PROTOCOL_VERSION, **body})


BAD_FRAMES = {
    "not msgpack": b"\xc1\xc1\xc1",
    "truncated": encode(Generate("r9", prompt="hello world"))[:-4],
    "trailing bytes": encode(Ping(1)) + b"\x00",
    "not a map": msgpack.packb([1, 2, 3]),
    "no version": msgpack.packb({"type": "ping", "nonce": 1}),
    "wrong version": msgpack.packb({"v": PROTOCOL_VERSION + 1, "type": "ping", "nonce": 1}),
    "unknown type": _raw(type="teleport"),
    "type of another channel": encode(TokenBatch(1, [], [])),
    "unknown field": _raw(type="generate", request_id="r", prompt="x", colour="red"),
    "missing field": _raw(type="abort"),
    "str for int": _raw(type="generate", request_id="r", prompt_token_ids=["1"]),
    "bool for int": _raw(type="ping", nonce=True),
    "float for int list": _raw(type="generate", request_id="r", prompt_token_ids=[1.5]),
    "map with int keys": msgpack.packb({"v": 1, "type": "generate", "request_id": "r", "sampling": {1: 2}}),
    "invalid utf-8": b"\x82\xa1v\x01\xa4type\xa4\xff\xfe\xfd\xfc",
    "empty": b"",
}


@pytest.mark.parametrize("frame", BAD_FRAMES.values(), ids=BAD_FRAMES.keys())
def test_bad_frames_raise_protocol_error(frame):
    with pytest.raises(ProtocolError):
        decode(frame, TO_SERVER)


def test_error_names_the_request_when_it_can():
    with pytest.raises(ProtocolError) as e:
        decode(_raw(type="generate", request_id="r7", prompt="x", colour="red"), TO_SERVER)
    assert e.value.request_id == "r7" and "colour" in str(e.value)


def test_nested_plan_is_checked():
    body = unpack(encode(ControlFrame(pack(PLAN), 0.0)))
    body["plan"][3] = "zero"  # the start_pos column
    with pytest.raises(ProtocolError, match="start_pos"):
        decode(msgpack.packb(body), channel(ControlFrame))
    body["plan"] = body["plan"][:3]  # a plan with fields missing
    with pytest.raises(ProtocolError):
        decode(msgpack.packb(body), channel(ControlFrame))


def test_channels_are_disjoint_where_it_matters():
    assert not TO_SERVER & TO_CLIENT
    assert "plan" not in TO_SERVER | TO_CLIENT


def test_older_frames_decode_with_the_newer_fields_defaults():
    """v3 added Generate.api_key and Stats.api_key: a v2 client's frames still decode (and fail auth, if any)."""
    v2 = decode(msgpack.packb({"v": 2, "type": "generate", "request_id": "r", "prompt": "x"}), TO_SERVER)
    assert v2.api_key == "" and decode(msgpack.packb({"v": 2, "type": "stats", "query_id": "q"}), TO_SERVER).api_key == ""
    assert decode(msgpack.packb({"v": 1, "type": "error", "error": "x"}), TO_CLIENT).code == "internal"
    assert decode(encode(Generate("r", prompt="x", api_key="k")), TO_SERVER).api_key == "k"


def test_add_request_carries_typed_params():
    """The frontend's parsed SamplingParams reach the scheduler as one (a nested dataclass), never a dict."""
    msg = decode(encode(AddRequest("#1", [1], SamplingParams(max_tokens=3, seed=9))), channel(AddRequest))
    assert isinstance(msg.params, SamplingParams) and msg.params.seed == 9 and msg.params.max_tokens == 3


def test_columns_must_be_equally_long():
    body = unpack(encode(Outputs(["r1", "r2"], [[1], [2]], ["a", "b"], [None, None])))
    body["texts"] = ["a"]
    with pytest.raises(ProtocolError, match="columns"):
        decode(msgpack.packb(body), TO_CLIENT)
    body = unpack(encode(TokenBatch(1, ["a", "b"], [1, 2])))
    body["token_ids"] = [1, 2, 3]
    with pytest.raises(ProtocolError, match="columns"):
        decode(msgpack.packb(body), channel(TokenBatch))


def test_columns_are_checked_by_type():
    body = unpack(encode(Outputs(["r1"], [[1]], ["a"], [Final("stop")])))
    for column, bad in [("request_ids", [1]), ("token_ids", [[True]]), ("texts", [b"a"]), ("finals", [["stop"]]),
                        ("finals", [[None, None, None, None]])]:
        with pytest.raises(ProtocolError, match=column):
            decode(msgpack.packb({**body, column: bad}), TO_CLIENT)


def test_an_older_peer_gets_frames_it_reads():
    """encode(msg, v) writes v and leaves out what came after v; a type newer than the frame's version is refused."""
    out = Output("r", [1], "x", True, "abort", code="aborted")
    assert unpack(encode(out, 3))["v"] == 3 and "code" in unpack(encode(out, 3))
    assert "code" not in unpack(encode(out, 1)) and decode(encode(out, 1), TO_CLIENT).code is None
    assert "api_key" not in unpack(encode(Generate("r", prompt="x", api_key="k"), 2))
    assert decode(encode(Error("e", "r", "overloaded"), 1), TO_CLIENT) == Error("e", "r")  # v1: code "internal"
    with pytest.raises(ValueError):
        encode(Outputs([], [], [], []), 3)
    with pytest.raises(ProtocolError, match="version 4"):
        decode(msgpack.packb({**unpack(encode(Outputs([], [], [], []))), "v": 3}), TO_CLIENT)


ROW = st.tuples(st.text(max_size=8), st.lists(st.integers(0, 1 << 20), max_size=3), st.text(max_size=8),
                st.none() | st.builds(Final, st.sampled_from(["stop", "length", "abort", "error"]), st.none() | st.text(max_size=8),
                                      st.none() | st.dictionaries(st.text(max_size=4), st.integers(-(1 << 63), (1 << 63) - 1), max_size=2),
                                      st.none() | st.text(max_size=8)))


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(ROW, max_size=6), finals=st.dictionaries(st.text(max_size=8), st.text(max_size=6), max_size=3))
def test_columnar_messages_round_trip(rows: list[tuple[Any, ...]], finals: dict[str, str]) -> None:
    out = Outputs(*(list(col) for col in zip(*rows))) if rows else Outputs([], [], [], [])
    assert decode(encode(out), TO_CLIENT) == out
    batch = TokenBatch(3, [r[0] for r in rows], [len(r[1]) for r in rows], finals)
    assert decode(encode(batch), channel(TokenBatch)) == batch


def test_float_columns_take_ints_and_refuse_the_rest():
    """A float column's fast path keeps floats as they are; an int is converted, a bool or a string refused,
    in a column of lists too (log probabilities' alternatives)."""
    lp = Logprobs([5], ["a"], [-0.5], [[5, 6]], [["a", "b"]], [[-0.5, -1.0]])
    body = unpack(encode(Outputs(["r"], [[5]], ["a"], [None], [lp])))
    assert decode(msgpack.packb(body), TO_CLIENT).logprobs == [lp]
    body["logprobs"][0][2], body["logprobs"][0][5] = [-1], [[0, -2.0]]
    got = decode(msgpack.packb(body), TO_CLIENT).logprobs[0]
    assert got.logprobs == [-1.0] and type(got.logprobs[0]) is float and got.top_logprobs == [[0.0, -2.0]]
    assert all(type(x) is float for x in got.top_logprobs[0])
    for bad in ([True], ["-1"], [[-1.0]]):
        body["logprobs"][0][2] = bad
        with pytest.raises(ProtocolError, match="logprobs"):
            decode(msgpack.packb(body), TO_CLIENT)
    body["logprobs"][0][2], body["logprobs"][0][5] = [-1.0], [[-1.0, False]]
    with pytest.raises(ProtocolError, match="top_logprobs"):
        decode(msgpack.packb(body), TO_CLIENT)


def test_a_relay_checks_the_columns_it_reads():
    """The broker settles requests from an outputs frame's request_ids and finals alone (codec.columns): each
    checked as a full decode checks it; a frame whose columns are missing, mistyped or uneven is refused."""
    from orca_mq.protocol.codec import columns

    body = unpack(encode(Outputs(["r1", "r2"], [[1], [2]], ["a", "b"], [None, Final("stop")])))
    assert columns(body, Outputs, "request_ids", "finals") == [["r1", "r2"], [None, Final("stop")]]
    for change, why in ((lambda b: b.pop("finals"), "missing field 'finals'"), (lambda b: b.update(finals=[None, 3]), "finals"),
                        (lambda b: b.update(request_ids=["r1"]), "differ in length"),
                        (lambda b: b.update(request_ids=["r1", 2]), "request_ids")):
        bad = dict(body)
        change(bad)
        with pytest.raises(ProtocolError, match=why):
            columns(bad, Outputs, "request_ids", "finals")
