"""The trainer: the fit loop, validation, checkpoints and metrics (the actor is `vlmrl.actor`)."""
