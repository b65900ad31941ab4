"""A run's components built from its config, shared by the fit loop and validation: the processor, the rollout
backend, the agent loop."""

from __future__ import annotations

from vlmrl.agent.loop import AgentLoop
from vlmrl.config import Config
from vlmrl.processors import Processor, load_processor
from vlmrl.rollout import RolloutBackend, start_backend


def load_run_processor(config: Config) -> Processor:
    """The processor of the run's model, with the data section's image and prompt-length settings."""
    return load_processor(config.actor.model_path, config.data)


def start_run_backend(config: Config, name: str | None = None, model_path: str | None = None,
                      colocated: bool = False) -> RolloutBackend:
    """The run's rollout backend (rollout.name, or `name`) on the actor's model (or `model_path`, e.g. a checkpoint
    folder), sized for the longest request (`config.derived.max_model_len`); `colocated`: a training actor shares
    its device (the engine then frees its memory while the actor trains, on a GPU, by default)."""
    return start_backend(config.rollout, model_path or config.actor.model_path, name=name, seed=config.trainer.seed,
                         max_model_len=config.derived.max_model_len, lora=config.actor.lora, colocated=colocated)


def start_agent(config: Config, backend: RolloutBackend, processor: Processor) -> AgentLoop:
    """The run's multi-turn loop (agent section) over `backend`, within the data section's prompt/response lengths."""
    return AgentLoop(backend, processor, config.agent, prompt_length=config.data.max_prompt_length,
                     response_length=config.data.max_response_length)
