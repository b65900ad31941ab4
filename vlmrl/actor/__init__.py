"""The policy being trained: its construction, logprobs, the PPO update loop, and the `PolicyActor` protocol the fit
loop drives.

    actor = Actor(config.actor, total_steps, mini_batch_samples=ppo_mini_batch_size * n)   # vlmrl.actor.local
    old, _ = actor.compute_logprobs(batch)              # skipped when not actor.needs_old_logprobs(len(batch))
    metrics = actor.update(batch, old, advantages)
    actor.sync_weights(backend)

- `policy`: ONE construction path (device, dtypes, load, frozen vision tower, reference, AdamW, lr schedule) for the
  single-process actor and every rank of the sharded one (`vlmrl.distributed.actor.ShardedActor`).
- `core`: micro-batches, the logprob pass and the update loop both run.
- `lora`: LoRA (PEFT) adapters, the reference as the base with adapters disabled, merged or adapter weight sync.
- `local`: the single-process `Actor`. `base`: the `PolicyActor` protocol, also implemented by
  `vlmrl.distributed.group.DistributedActor`.
"""
