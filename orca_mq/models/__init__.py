"""The models orca-mq serves: one file per family on shared layers (layers/), a registry keyed by what a
checkpoint calls itself, checkpoint files and weight loading. engine/ runs them; it never asks which family."""
