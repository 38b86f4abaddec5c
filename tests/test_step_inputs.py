"""The iteration's inputs (orca_mq/engine/step_inputs.py) and the CUDA-graph buckets built on them:
the array arithmetic agrees with a row-by-row reference on any plan (hypothesis), a bucket's padding
rows touch only the scratch block, wrong plans are refused before any kernel, and on the CPU the
graph path (same buckets, padding and static buffer, the forward called instead of replayed) gives
the eager path's logits and KV."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orca_mq.config import load_config
from orca_mq.engine.graphs import buckets, token_buckets
from orca_mq.engine.model_runner import ModelRunner
from orca_mq.engine.step_inputs import Bucket, Geometry, HostStep, build, layout, write
from orca_mq.protocol.iteration import IterationPlan, SeqWork, pack

BS = 4
GEOMETRY = dict(block_size=BS, num_blocks=64, vocab_size=100, max_len=120)


def _reference(seqs: list[SeqWork], token_rows: bool) -> dict[str, list]:
    """What each field must hold, computed the plain way: row by row, token by token."""
    out: dict[str, list] = {k: [] for k in ("positions", "slot_mapping", "seq_lens", "logit_rows", "decode_tokens", "decode_lens")}
    cu, row = [0], 0
    for s in seqs:
        for i, pos in enumerate(range(s.start_pos, s.seq_len)):
            out["positions"].append(pos)
            out["slot_mapping"].append(s.block_table[pos // BS] * BS + pos % BS)
            if token_rows or len(s.token_ids) == 1:
                out["decode_tokens"].append(row + i)
                out["decode_lens"].append(pos + 1)
            if token_rows:
                cu.append(row + i + 1)
                out["seq_lens"].append(pos + 1)
        if not token_rows:
            cu.append(row + len(s.token_ids))
            out["seq_lens"].append(s.seq_len)
        row += len(s.token_ids)
        if s.sample:
            out["logit_rows"].append(row - 1)
    out["cu_q_lens"] = cu
    return out


@st.composite
def plans(draw) -> list[SeqWork]:
    seqs = []
    for i in range(draw(st.integers(1, 6))):
        start = draw(st.integers(0, 60))
        q = draw(st.integers(1, 12))
        table = draw(st.lists(st.integers(0, 63), min_size=-(-(start + q) // BS), max_size=-(-(start + q) // BS) + 2))
        seqs.append(SeqWork(f"r{i}", draw(st.lists(st.integers(0, 99), min_size=q, max_size=q)), start, table,
                            sample=draw(st.booleans())))
    return seqs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seqs=plans(), token_rows=st.booleans(), split=st.booleans())
def test_inputs_match_a_row_by_row_reference(seqs: list[SeqWork], token_rows: bool, split: bool) -> None:
    step = build(pack(IterationPlan(1, seqs)).arrays(), Geometry(**GEOMETRY, token_rows=token_rows, split_decode=split))
    ref = _reference(seqs, token_rows)
    f = step.fields
    for name in ("positions", "slot_mapping", "seq_lens", "logit_rows", "cu_q_lens"):
        assert f[name].tolist() == ref[name], name
    assert f["token_ids"].tolist() == [t for s in seqs for t in s.token_ids]
    if split:
        assert f["decode_tokens"].tolist() == ref["decode_tokens"] and f["decode_lens"].tolist() == ref["decode_lens"]
        cached = [s.block_table[p // BS] * BS + p % BS for s in seqs if len(s.token_ids) > 1 and not token_rows
                  for p in range(s.start_pos)]
        assert f["prefill_cached"].tolist() == cached
    # every attention row's table starts with its request's blocks
    rows = [s for s in seqs for _ in (s.token_ids if token_rows else [0])]
    for r, s in enumerate(rows):
        assert f["block_tables"][r, : len(s.block_table)].tolist() == s.block_table


def test_padding_rows_use_only_the_scratch_block() -> None:
    """A decode bucket: padding tokens are one-token rows on the scratch block."""
    seqs = [SeqWork("a", [5], 9, [3, 7, 8]), SeqWork("b", [6], 2, [4])]
    step = build(pack(IterationPlan(1, seqs)).arrays(), Geometry(**GEOMETRY, token_rows=False, split_decode=True))
    lay = layout(8, 8, 30, 8, 8, 8, 0)
    buf = np.full(lay.nbytes, 0xAB, np.uint8)   # what an earlier iteration left there
    write(step, lay, buf, scratch_block=64, bucket=Bucket(8, 8, 8, True))
    v = lay.host_views(buf)
    assert v["slot_mapping"][2:].tolist() == [64 * BS] * 6 and v["seq_lens"][2:].tolist() == [1] * 6
    assert (v["block_tables"][2:, 0] == 64).all() and (v["block_tables"][2:, 1:] == 0).all()
    assert v["cu_q_lens"].tolist() == list(range(9)) and v["logit_rows"].tolist() == [0, 1] + [0] * 6
    assert v["decode_lens"][2:].tolist() == [1] * 6 and (v["decode_blocks"][2:, 0] == 64).all()


def test_a_mixed_bucket_pads_tokens_as_rows_then_empty_rows() -> None:
    """A mixed bucket: a prompt chunk and a decode (4 tokens, 2 rows) padded to 12 tokens and 12 rows:
    8 one-token rows on the scratch block, then 2 empty rows."""
    seqs = [SeqWork("a", [5, 6, 7], 0, [3]), SeqWork("b", [6], 2, [4])]
    step = build(pack(IterationPlan(1, seqs)).arrays(), Geometry(**GEOMETRY, token_rows=False, split_decode=False))
    lay = layout(12, 12, 30, 4, 4, 0, 0)
    buf = np.full(lay.nbytes, 0xAB, np.uint8)
    write(step, lay, buf, scratch_block=64, bucket=Bucket(12, 12, 4, False))
    v = lay.host_views(buf)
    assert v["cu_q_lens"].tolist() == [0, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 12, 12]
    assert v["seq_lens"].tolist() == [3, 3] + [1] * 8 + [0] * 2
    assert v["slot_mapping"].tolist() == [3 * BS, 3 * BS + 1, 3 * BS + 2, 4 * BS + 2] + [64 * BS] * 8
    assert v["positions"].tolist() == [0, 1, 2, 2] + [0] * 8 and v["token_ids"].tolist() == [5, 6, 7, 6] + [0] * 8
    assert v["block_tables"][:, 0].tolist() == [3, 4] + [64] * 8 + [0] * 2 and not v["block_tables"][:, 1:].any()
    assert v["logit_rows"].tolist() == [2, 3, 0, 0]


@pytest.mark.parametrize("bad,why", [
    (SeqWork("a", [5], 200, list(range(60))), "beyond the model"),
    (SeqWork("a", [5], 9, [1, 2]), "cannot hold"),
    (SeqWork("a", [5], 0, [64]), "outside the pool"),
    (SeqWork("a", [100], 0, [1]), "vocabulary"),
])
def test_a_plan_the_model_cannot_run_is_refused(bad: SeqWork, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        build(pack(IterationPlan(1, [bad])).arrays(), Geometry(**GEOMETRY, token_rows=False, split_decode=False))


def test_buckets_cover_every_batch_size() -> None:
    for max_bs in (1, 7, 32, 128, 500, 512):
        b = buckets(max_bs)
        assert b[0] == 1 and b[-1] == max_bs and b == sorted(set(b))
        assert all(nxt <= 2 * prev or nxt - prev <= 64 for prev, nxt in zip(b, b[1:]))   # padding waste bounded


def _runner(model_dir, graphs: str) -> ModelRunner:
    cfg = load_config(overrides={"model.path": str(model_dir), "model.dtype": "float32", "engine.n_slots": 64 * 16,
                                 "engine.block_size": 16, "engine.cuda_graphs": graphs, "scheduler.max_bs": 8})
    return ModelRunner(cfg)


def test_graph_path_on_the_cpu_matches_eager(tiny_llama_dir) -> None:
    """Decode-only iterations of 1..8 rows through the padded static buffer: the eager logits and the
    same K/V in every real block; the bucket's padding wrote only the scratch block."""
    eager, padded = _runner(tiny_llama_dir, "off"), _runner(tiny_llama_dir, "on")
    assert eager.graphs is None and padded.graphs is not None and padded.graphs.sizes == buckets(8)
    rng = np.random.default_rng(0)
    for n in (1, 3, 5, 8):
        prompts = [SeqWork(f"r{i}", rng.integers(0, 500, 20).tolist(), 0, [2 * i, 2 * i + 1]) for i in range(n)]
        decodes = [SeqWork(s.request_id, [int(rng.integers(0, 500))], 20, s.block_table) for s in prompts]
        for r in (eager, padded):
            r.forward(IterationPlan(1, prompts))   # mixed/prefill: eager on both
        size = buckets(8)[int(np.searchsorted(buckets(8), n))]
        assert padded.graphs.fits(build(pack(IterationPlan(2, decodes)).arrays(), padded.geometry)) == Bucket(size, size, size, True)
        assert padded.graphs.fits(build(pack(IterationPlan(1, prompts)).arrays(), padded.geometry)) is None  # cpu: prompts eager
        a, b = eager.forward(IterationPlan(2, decodes)), padded.forward(IterationPlan(2, decodes))
        assert a.shape == b.shape == (n, eager.info.vocab_size)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)   # fp32; a padded GEMM may take another kernel
        real = slice(0, 2 * n)
        torch.testing.assert_close(eager.kv.k[:, real], padded.kv.k[:, real], rtol=1e-5, atol=1e-5)
        assert not padded.kv.k[:, 2 * n: 64].any() and not eager.kv.k[:, 64].any()   # no stray writes
    assert padded.kv.k[:, 64].any()   # the padding rows' writes landed in the scratch block


def test_buckets_of_mixed_iterations() -> None:
    assert token_buckets(0) == [] and token_buckets(300) == [256, 300]
    assert token_buckets(8192)[:9] == [256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560] and token_buckets(8192)[-1] == 8192


def test_empty_step_lays_out_a_bucket() -> None:
    step = HostStep.empty(BS, 5)
    lay = layout(4, 4, 5, 4, 4, 0, 0)
    buf = np.zeros(lay.nbytes, np.uint8)
    write(step, lay, buf, scratch_block=9, bucket=Bucket(4, 4, 4, True))
    assert lay.host_views(buf)["slot_mapping"].tolist() == [9 * BS] * 4


def test_warm_up_iteration_runs_on_any_device(tiny_llama_dir) -> None:
    """What a CUDA stage runs at start to compile the mixed iterations' kernels: one prompt chunk
    beside a decode, on the pool's first blocks."""
    runner = _runner(tiny_llama_dir, "off")
    runner._warm_up()
    assert runner.kv.k[:, :4].any()


def test_every_bucket_stages_valid_inputs_to_capture_on() -> None:
    """What each bucket is captured on (its padding, or a mixed bucket's tokens spread over its rows)
    lays out within the static buffer, every row's tokens covered by scratch blocks of its table."""
    from orca_mq.engine.graphs import Graphs
    from orca_mq.engine.staging import Stager

    stager = Stager(torch.device("cpu"), scratch_block=64)
    for max_bs, budget in ((4, 2048), (128, 8192), (512, 8192), (32, 256)):
        g = Graphs(lambda ids, meta: (ids, ids), max_bs, budget, 128, False, False, stager, 16, 100, torch.float32,
                   torch.device("cpu"))
        assert g.capture() and len(g.views) == len(g.sizes) + len(g.token_sizes)
        for bucket in g.all:
            step = g._placeholder(bucket)
            stager.stage(step, g.layout, g.buf, bucket)
            v = g.layout.device_views(g.buf)
            cu, lens = v["cu_q_lens"][: bucket.rows + 1], v["seq_lens"][: bucket.rows]
            assert int(cu[-1]) == bucket.tokens and bool((cu[1:] - cu[:-1] == lens).all())   # keys = own tokens
            blocks = (v["block_tables"][: bucket.rows] == 64).sum(dim=1)
            assert bool((blocks * 16 >= lens).all()) and bool((v["slot_mapping"][: bucket.tokens] // 16 == 64).all())
