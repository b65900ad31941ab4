"""The trainer as a side of `python -m vlmrl.alignment.compare` (`--backends trainer,X`): its name and what the
trainer side refuses before anything loads. The side itself (the actor scoring an engine's samples teacher-forced) is
`vlmrl.trainer.teacher_forcing`, a process compare starts, so this package never imports the trainer."""

from __future__ import annotations

from vlmrl.config import Config

TRAINER = "trainer"
"""The side's name in compare's --backends and in the artifact's header (`ArtifactMeta.backend`)."""
SIDE_MODULE = "vlmrl.trainer.teacher_forcing"
"""What compare runs (`python -m ...`) for the trainer side."""


class TrainerSideError(ValueError):
    """A config or reference artifact the trainer side cannot score (compare exits 2)."""


def check_config(config: Config, drill: bool = False) -> None:
    """Refuses what the trainer side cannot reproduce, before anything loads. `drill`: the per-module drill-down is
    asked for."""
    if drill and config.derived.world_size != 1:
        raise TrainerSideError(f"--drill-down hooks the modules of one unsharded model; trainer.n_gpus_per_node x "
                               f"trainer.nnodes = {config.derived.world_size}: drill down with both set to 1 (the "
                               "sharded actor's logprobs equal the single device's, tests/distributed)")
    if config.agent.enable:
        raise TrainerSideError("agent.enable=true: the trainer side scores single-turn validation samples only")
