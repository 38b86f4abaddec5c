"""The layers families share: rotary variants, dense MLPs, mixtures of experts."""
