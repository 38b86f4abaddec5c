"""A request's one way in: its sampling parameters, prompt and limits checked once, where they
enter, its grammar compiled, the scheduler's Request built (`ServedModel`). The frontend, the
scheduler process and the offline LLM all go through it; they differ only in their I/O."""
