"""Step metrics of the agent loop: turns, tool use, end reasons, batching, and staleness (partial rollout)."""

from __future__ import annotations

from collections.abc import Sequence

from vlmrl.agent.batcher import BatcherStats
from vlmrl.agent.trajectory import TOOL_VERSION, AgentSample


def staleness(samples: Sequence[AgentSample], current_version: int) -> dict[str, float]:
    """How many policy tokens of the batch came from older policies.

    Keys: partial/stale_tokens (count), partial/stale_token_fraction (of all policy tokens), partial/stale_samples
    (samples holding any), partial/max_version_lag (current - oldest version seen; 0 when none is stale).
    """
    total = stale = stale_samples = 0
    lag = 0
    for s in samples:
        versions = s.token_versions[s.token_versions > TOOL_VERSION]  # policy tokens only
        old = versions < current_version
        total += int(versions.numel())
        stale += int(old.sum())
        stale_samples += bool(old.any())
        if versions.numel():
            lag = max(lag, current_version - int(versions.min()))
    return {"partial/stale_tokens": float(stale), "partial/stale_token_fraction": stale / total if total else 0.0,
            "partial/stale_samples": float(stale_samples), "partial/max_version_lag": float(max(lag, 0))}


def step_metrics(samples: Sequence[AgentSample], stats: BatcherStats, current_version: int,
                 tool_names: Sequence[str]) -> dict[str, float]:
    """Means per sample of turns and tool counters, the share of each end reason, tool rewards, batching counts."""
    metrics: dict[str, float] = {
        "agent/generate_calls": float(stats.calls),
        "agent/requests_per_call/mean": stats.requests / stats.calls if stats.calls else 0.0,
        "agent/cut_tokens": float(stats.cut_tokens),
        "agent/withdrawn_turns": float(stats.withdrawn),
    }
    if not samples:
        return metrics
    count = len(samples)
    metrics["agent/turns/mean"] = sum(s.num_turns for s in samples) / count
    metrics["agent/turns/max"] = float(max(s.num_turns for s in samples))
    policy = [float(s.sample.response_mask.sum()) for s in samples]
    real = [float(s.sample.attention_mask[s.sample.prompt_ids.shape[0]:].sum()) for s in samples]
    metrics["agent/policy_tokens/mean"] = sum(policy) / count
    metrics["agent/tool_tokens/mean"] = (sum(real) - sum(policy)) / count
    for reason in sorted({s.end_reason for s in samples}):
        metrics[f"agent/end/{reason}"] = sum(s.end_reason == reason for s in samples) / count
    names = sorted({k for s in samples for k in s.counters})
    for name in names:
        metrics[f"agent/{name}/mean"] = sum(s.counters.get(name, 0.0) for s in samples) / count
    for tool in tool_names:
        values = [s.sample.reward_extra[f"tool/{tool}"] for s in samples if f"tool/{tool}" in s.sample.reward_extra]
        if values:
            metrics[f"agent/tool/{tool}/reward/mean"] = sum(values) / len(values)
    metrics.update(staleness(samples, current_version))
    return metrics
