"""tools/bench.py's replayer over a real server (a tiny random Llama with the embedded tokenizer): what
it asks of the sampler."""
from __future__ import annotations

import asyncio
import functools
import time


def test_a_sampled_replay_samples_as_asked_and_reproduces(tmp_path, tiny_served_dir):
    """tools/bench.py --sampling: the replayer's requests sample (a random model's temperature-1 draws are
    not its argmax), the same seed gives the same tokens, and greedy stays the default."""
    from orca_mq.bench.replay import SampledClient, new_record, open_client, run_request
    from serving_harness import start_server

    srv = start_server(tmp_path, **{"model.path": str(tiny_served_dir), "model.max_model_len": 256})

    async def texts(factory) -> list[str]:
        async with factory(srv.address) as client:
            out = []
            for i in range(3):
                text: list[str] = []
                rec = await run_request(client, new_record(i, 0.0, 8 + i, 6), {"prompt_token_ids": list(range(100, 108 + i))},
                                        time.perf_counter, timeout=60, text=text)
                assert rec["error"] is None and rec["generated_tokens"] == 6, rec
                out.append("".join(text))
            return out

    try:
        sampled = functools.partial(SampledClient, sampling={"temperature": 1.0, "seed": 7, "logprobs": 2})
        greedy, first, again = (asyncio.run(texts(f)) for f in (open_client, sampled, sampled))
        assert first == again != greedy
        assert asyncio.run(texts(open_client)) == greedy
    finally:
        assert srv.stop() == 0, srv.stderr()[-3000:]
