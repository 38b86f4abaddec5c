"""Speculative decoding by n-gram prompt lookup, inside iteration-level batching.

A request decoding freely proposes up to k tokens: those that followed the most recent earlier
occurrence of its last n tokens (n from `lookup_max` down to `lookup_min`) in its prompt and output.
Its row of the next iteration is then a short chunk, its last token and the draft (SeqWork.draft);
the last stage samples after each of them and keeps the longest prefix that agrees (so greedy output
is unchanged, and sampled output keeps its distribution: engine/sampler.py), and the scheduler
appends what it kept. The KV the rejected tokens wrote lies past the request's length: the next
iteration overwrites it, and the blocks only they needed return to the pool (`BlockManager.trim`).

Drafts are the iteration's last claim on compute: they fill it only up to `max_batch_tokens` tokens
(and the token budget), after every increment and prompt chunk has its share, so at a full batch
speculation gives way. Each request adapts its own k to what it accepts, and one whose drafts keep
failing stops proposing for a while (twice as long after each further miss).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from orca_mq.sched.spec_state import NgramIndex, SpecCounters, SpecState

if TYPE_CHECKING:
    from orca_mq.config import SpeculativeConfig
    from orca_mq.structured.budget import Budget
    from orca_mq.protocol.iteration import SeqWork
    from orca_mq.sched.request import Request

MAX_BACKOFF = 64   # iterations a request at most waits before it proposes again


class Speculator:
    """Proposes the drafts of an iteration's increment rows and learns from what they kept."""

    def __init__(self, cfg: "SpeculativeConfig", token_budget: int) -> None:
        self.cfg = cfg
        self.cap = min(cfg.max_batch_tokens, token_budget) if token_budget else cfg.max_batch_tokens
        self.counters = SpecCounters(accepted_per_pos=[0] * cfg.num_tokens)
        self.spare = self.cap   # draft tokens the next iteration may hold (the last one's room), less those promised

    @staticmethod
    def eligible(req: "Request") -> bool:
        """Whether the last stage can sample each of its verify positions alike. Requests with penalties
        or biases (their history and min_tokens' count move with each token) or log probabilities (one
        entry a row) decode one token at a time; a grammar's masks follow the draft (`mask_drafts`)."""
        p = req.params
        return (p.logprobs is None and p.presence_penalty == 0 and p.frequency_penalty == 0
                and p.repetition_penalty == 1 and not p.logit_bias and p.min_tokens == 0 and p.min_p == 0)

    def propose(self, batch: list["Request"], tokens: int, max_len: int) -> dict[str, list[int]]:
        """Drafts for the batch's increment rows, in batch order, while the iteration (`tokens` so
        far) stays within the cap; none past a request's max_tokens or the model's length."""
        room = self.spare = self.cap - tokens
        out: dict[str, list[int]] = {}
        for req in batch:
            spec = req.spec
            if spec is None or req.prompt_pending or not self.eligible(req):
                continue
            if spec.wait:   # a back-off counts the iterations a request takes part in, planned ahead or not
                spec.wait -= 1
                continue
            if room <= 0 or req.running:   # planned ahead: its last token is not known yet
                continue
            k = min(spec.k, room, req.params.max_tokens - len(req.output_token_ids) - 1, max_len - req.num_tokens)
            if k <= 0:
                continue
            draft = self._index(req).propose(k)
            if draft:
                out[req.request_id] = draft
                room -= len(draft)
        return out

    @staticmethod
    def mask_drafts(seqs: list["SeqWork"], batch: list["Request"], planning: "Budget") -> None:
        """A constrained verify row's masks after each of its draft tokens, from its grammar advanced by
        them on a fork (the budget's closing and the digit bound included); its draft cut before a token
        the grammar rejects, or whose closing plan does not fit the iteration's `planning`, and after one
        that ends it (nothing after that token is kept)."""
        for s, req in zip(seqs, batch):
            if not s.draft or req.grammar is None or req.grammar.matcher is None:
                continue
            fork, masks, kept = req.grammar.fork(), [], 0
            for token in s.token_ids[len(s.token_ids) - s.draft:]:
                reason = fork.accept(token)
                if reason == "error" or reason is None and not fork.prepare(planning):
                    break
                kept += 1
                if reason == "stop":
                    break
                masks.append(fork.mask())
            if kept < s.draft:
                del s.token_ids[len(s.token_ids) - s.draft + kept:]
                s.draft = req.draft = kept
            s.draft_bitmasks = masks

    def will_draft(self, req: "Request") -> bool:
        """Whether a request is likely to propose a draft once its token in flight is back (its tokens so
        far end in an n-gram seen before, no back-off, room left for drafts in the next iteration as the
        last one's rows leave it, less the k of each request already held back): under async scheduling it
        then waits for that token rather than being planned ahead, which would leave it never idle when
        drafts are proposed (async scheduling on and no draft at all, before). It takes part in every other
        iteration then, which pays where a draft keeps a token or more; one that keeps missing backs off,
        and without room it is planned ahead (at a full batch it would wait for no draft)."""
        spec = req.spec
        if spec is None or spec.wait or self.spare <= 0 or not self.eligible(req) or not self._index(req).propose(1):
            return False
        self.spare -= spec.k
        return True

    @staticmethod
    def _index(req: "Request") -> "NgramIndex":
        """The request's n-gram index, its output tokens added."""
        spec = req.spec
        assert spec is not None
        spec.index.extend(req.output_token_ids[len(spec.index.tokens) - len(req.prompt_token_ids):])
        return spec.index

    def learn(self, req: "Request", drafted: int, kept: int) -> None:
        """A verify row came back keeping `kept` of its `drafted` tokens: k follows what it keeps."""
        spec, c = req.spec, self.counters
        assert spec is not None
        spec.drafts, spec.drafted, spec.accepted = spec.drafts + 1, spec.drafted + drafted, spec.accepted + kept
        c.drafts, c.draft_tokens, c.accepted_tokens = c.drafts + 1, c.draft_tokens + drafted, c.accepted_tokens + kept
        for i in range(kept):
            c.accepted_per_pos[i] += 1
        spec.k = max(1, min(self.cfg.num_tokens, kept + 1 if kept < drafted else drafted + 1))
        spec.misses = 0 if kept else spec.misses + 1
        if spec.misses >= 2:
            spec.wait = min(MAX_BACKOFF, 1 << (spec.misses - 1))

    def start(self, req: "Request") -> None:
        """A request joins: its index starts from its prompt."""
        req.spec = SpecState(NgramIndex(self.cfg.lookup_min, self.cfg.lookup_max, list(req.prompt_token_ids)),
                             self.cfg.num_tokens)

    @staticmethod
    def metrics(req: "Request") -> dict[str, int]:
        spec = req.spec
        if spec is None:
            return {}
        return {"spec_drafts": spec.drafts, "spec_draft_tokens": spec.drafted, "spec_accepted_tokens": spec.accepted}
