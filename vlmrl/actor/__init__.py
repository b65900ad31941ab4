"""The policy being trained: its construction, logprobs, the PPO update loop, and the `PolicyActor` protocol the fit
loop drives.

    actor = Actor(config.actor, total_steps, mini_batch_samples=ppo_mini_batch_size * n)
    old, _ = actor.compute_logprobs(batch)              # skipped when not actor.needs_old_logprobs(len(batch))
    metrics = actor.update(batch, old, advantages)
    actor.sync_weights(backend)

- `policy`: ONE construction path (device, dtypes, load, frozen vision tower, reference, AdamW, lr schedule) for the
  single-process actor and every rank of the sharded one (`vlmrl.distributed.actor.ShardedActor`).
- `core`: micro-batches, the logprob pass and the update loop both run.
- `lora`: LoRA (PEFT) adapters, the reference as the base with adapters disabled, merged or adapter weight sync.
- `local`: the single-process `Actor`. `base`: the `PolicyActor` protocol, also implemented by
  `vlmrl.distributed.DistributedActor`.
"""

from vlmrl.utils.lazy import lazy_exports

# Imported on first use: the run config reads this package's config module and must not import torch.
_LAZY = {
    "PolicyActor": "base",
    "ActorCore": "core",
    "MicroBatch": "core",
    "chunks": "core",
    "forward_response": "core",
    "mean_metrics": "core",
    "micro_batch": "core",
    "needs_old_logprobs": "core",
    "Actor": "local",
    "LoraSync": "lora",
    "adapters_disabled": "lora",
    "apply_lora": "lora",
    "merged_names": "lora",
    "merged_tensors": "lora",
    "write_adapter": "lora",
    "DTYPES": "policy",
    "Policy": "policy",
    "build_policy": "policy",
    "load_policy": "policy",
    "lr_lambda": "policy",
    "resolve_device": "policy",
    "resolve_dtype": "policy",
}


__getattr__ = lazy_exports(__name__, _LAZY)


__all__ = sorted(_LAZY)
