"""How far the trainer's logprobs are from the engine's that sampled the tokens: the training/inference mismatch,
measured every step on the tokens the update uses, with no extra forward (the update's own pre-update logprobs).

Per token, with r = old - rollout (the trainer's minus the engine's logprob of the sampled token) and w = exp(r)
the importance ratio trainer/engine:
    k1      mean(-r)                   KL(engine || trainer), the plain estimator (can be negative on a batch)
    k3      mean(w - 1 - r)            the same KL, low variance and never negative (Schulman's k3)
    chi2    mean((w - 1)^2)            chi-square divergence of trainer from engine (the IS weights' variance)
    ess     (sum w)^2 / (N sum w^2)    effective sample size of the IS weights, as a fraction of the N tokens
    ppl_ratio exp(mean(-r))            the trainer's perplexity over the engine's on these tokens
    abs_dlogp_max, abs_dlogp_p99, ratio_p01/p50/p99, over_threshold (fraction of tokens with |r| > threshold).
Means are over tokens. Healthy values: fp32 engine and trainer agree to ~1e-6 per token (k3 ~1e-12, ess 1.0); a
bf16 engine against an fp32 trainer gives |r| ~1e-2, k3 ~1e-4..1e-3, ess > 0.99; k3 above ~1e-2, ess below ~0.9 or
a jump between steps says the trainer is not computing what the engine sampled (see docs/alignment.md).

Everything is kept as sums (plus the values for the quantiles), so micro-batches, mini-batches and groups (data
source, modality, and the engine that sampled the row when a run has several: one engine group off shows as its own
group) combine exactly before the metrics are read once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

QUANTILES = {"ratio_p01": 0.01, "ratio_p50": 0.5, "ratio_p99": 0.99}
"""IS-ratio quantiles reported (of w over the tokens)."""


class MismatchAccumulator:
    """Collects the per-token gaps of one step, micro-batch by micro-batch, overall and per group; `metrics()`
    reads them (one host sync).

    >>> acc = MismatchAccumulator(threshold=0.1)
    >>> old = torch.tensor([[-2.0, -2.0], [-1.0, -1.0]]); rollout = torch.tensor([[-2.3, -2.1], [-1.0, -1.0]])
    >>> acc.add(old, rollout, torch.ones(2, 2), ["geo", "geo"], ["image", "text"])
    >>> m = acc.metrics()
    >>> round(m["mismatch/k1"], 4), round(m["mismatch/abs_dlogp_max"], 4), m["mismatch/over_threshold"]
    (-0.1, 0.3, 0.25)
    >>> round(m["mismatch/modality/text/k3"], 6), m["mismatch/source/geo/tokens"]
    (0.0, 4.0)
    """

    def __init__(self, threshold: float = 0.1):
        self.threshold = threshold
        self._values: dict[str, list[torch.Tensor]] = {}  # group -> r of its tokens, per micro-batch

    def add(self, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, sources: Sequence[str],
            modalities: Sequence[str], engines: Sequence[int] = ()) -> None:
        """One micro-batch: (B, R) trainer and engine logprobs of the sampled tokens, the (B, R) loss mask, and each
        row's data source and modality (text, image, video); with several engines, each row's engine index (-1: a
        padding row), which adds the group engine/<index>."""
        r = (old.detach().to(torch.float64) - rollout.to(device=old.device, dtype=torch.float64))
        keep = mask.to(old.device) > 0
        self._values.setdefault("", []).append(r[keep])
        if engines and len(engines) != len(sources):
            raise ValueError(f"{len(engines)} engine indices for {len(sources)} rows")
        for row, (source, modality) in enumerate(zip(sources, modalities, strict=True)):
            values = r[row][keep[row]]
            groups = [f"source/{source}", f"modality/{modality}"]
            if engines and engines[row] >= 0:
                groups.append(f"engine/{engines[row]}")
            for group in groups:
                self._values.setdefault(group, []).append(values)

    def metrics(self) -> dict[str, float]:
        """mismatch/<name> overall, mismatch/source/<data source>/<name>, mismatch/modality/<text|image|video>/<name>
        and (several engines) mismatch/engine/<index>/<name> per group (k1, k3, chi2, abs_dlogp_max, over_threshold,
        tokens); empty when no token was added."""
        out: dict[str, float] = {}
        for group, parts in self._values.items():
            r = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
            if r.numel() == 0:
                continue
            prefix = "mismatch/" if not group else f"mismatch/{group}/"
            w = torch.exp(r)
            stats = {"k1": (-r).mean(), "k3": (w - 1 - r).mean(), "chi2": ((w - 1) ** 2).mean(),
                     "abs_dlogp_max": r.abs().max(), "over_threshold": (r.abs() > self.threshold).double().mean(),
                     "tokens": torch.tensor(float(r.numel()), dtype=torch.float64)}
            if not group:
                stats.update(ess=w.sum() ** 2 / (r.numel() * (w ** 2).sum()), ppl_ratio=torch.exp((-r).mean()),
                             abs_dlogp_p99=torch.quantile(r.abs(), 0.99))
                levels = torch.tensor(list(QUANTILES.values()), dtype=torch.float64, device=w.device)
                stats.update(zip(QUANTILES, torch.quantile(w, levels)))
            names = list(stats)
            values = torch.stack([stats[k].to(torch.float64).reshape(()) for k in names]).tolist()
            out.update({prefix + k: v for k, v in zip(names, values)})
        return out


def modality(multi_modal_inputs: dict) -> str:
    """A row's modality for the per-group metrics: video (any video), image (any image), else text."""
    if "pixel_values_videos" in multi_modal_inputs:
        return "video"
    return "image" if "pixel_values" in multi_modal_inputs else "text"
