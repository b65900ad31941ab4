"""The trainer: actor (logprobs, GRPO update), the fit loop, validation, checkpoints and metrics."""
