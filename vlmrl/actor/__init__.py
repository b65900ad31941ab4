"""The policy being trained: its construction, logprobs, the PPO update loop, and the `PolicyActor` protocol the fit
loop drives.

    actor = Actor(config.actor, total_steps, mini_batch_samples=ppo_mini_batch_size * n)
    old, _ = actor.compute_logprobs(batch)              # skipped when not actor.needs_old_logprobs(len(batch))
    metrics = actor.update(batch, old, advantages)
    actor.sync_weights(backend)

- `policy`: ONE construction path (device, dtypes, load, frozen vision tower, reference, AdamW, lr schedule) for the
  single-process actor and every rank of the sharded one (`vlmrl.distributed.actor.ShardedActor`).
- `core`: micro-batches, the logprob pass and the update loop both run.
- `local`: the single-process `Actor`. `base`: the `PolicyActor` protocol, also implemented by
  `vlmrl.distributed.DistributedActor`.
"""

from vlmrl.actor.base import PolicyActor
from vlmrl.actor.core import ActorCore, MicroBatch, chunks, forward_response, micro_batch, needs_old_logprobs
from vlmrl.actor.local import Actor
from vlmrl.actor.policy import DTYPES, Policy, build_policy, load_policy, lr_lambda, resolve_device, resolve_dtype

__all__ = [
    "DTYPES", "Actor", "ActorCore", "MicroBatch", "Policy", "PolicyActor", "build_policy", "chunks",
    "forward_response", "load_policy", "lr_lambda", "micro_batch", "needs_old_logprobs", "resolve_device",
    "resolve_dtype",
]
