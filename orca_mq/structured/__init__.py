"""Structured outputs: a request's output constrained to a JSON schema, JSON object, regex, choice or
grammar, inside selective batching (the grammar engine is llguidance).

The constraint a request carries (`SamplingParams.structured_outputs`, shape checks only) is a wire
type: `orca_mq.protocol.structured`.
- `compiler`: a constraint -> a checked grammar (cached, bounded in size and time) and, with the
  model's vocabulary, a per-request `Grammar`.
- `grammar`: one request's matcher, advanced by its accepted tokens; lives on the scheduler's Request.
- `bitmask`: the allowed-token bitmasks of an iteration's constrained rows, in one batched call.
- `budget`: JSON that finishes within max_tokens: the shortest way to finish from a grammar's state,
  forced as the budget runs out; `tokens`: the vocabulary's tokens as bytes, where JSON text stands,
  and the masks of the tokens that keep a number's digits bounded.

The iteration loop calls three things: `fill_masks` when it builds rows, `Grammar.accept` when a
token is appended, `Grammar.release` when the request finishes.
"""
