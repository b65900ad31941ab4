"""The trainer as a side of `python -m vlmrl.alignment.compare` (`--backends trainer,X`): its name and what the
trainer side refuses before anything loads. The side itself (the actor scoring an engine's samples teacher-forced) is
`vlmrl.trainer.trainer_side`, a process compare starts, so this package never imports the trainer."""

from __future__ import annotations

from vlmrl.config import Config

TRAINER = "trainer"
"""The side's name in compare's --backends and in the artifact's header (`ArtifactMeta.backend`)."""
SIDE_MODULE = "vlmrl.trainer.trainer_side"
"""What compare runs (`python -m ...`) for the trainer side."""


class TrainerSideError(ValueError):
    """A config or reference artifact the trainer side cannot score (compare exits 2)."""


def check_config(config: Config) -> None:
    """Refuses what the trainer side cannot reproduce, before anything loads."""
    if config.derived.world_size != 1:
        raise TrainerSideError(f"the trainer side runs on one device; trainer.n_gpus_per_node x trainer.nnodes = "
                               f"{config.derived.world_size} (set both to 1: the sharded actor computes the same "
                               "logprobs, tests/distributed checks dp=2 == dp=1)")
    if config.agent.enable:
        raise TrainerSideError("agent.enable=true: the trainer side scores single-turn validation samples only")
