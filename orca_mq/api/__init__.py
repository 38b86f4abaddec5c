"""The OpenAI-compatible HTTP API: one more client of the broker, and its Prometheus metrics."""
