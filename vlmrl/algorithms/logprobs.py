"""Logprobs and entropy of the response tokens from the model's last hidden states, in chunks of tokens.

The full-vocabulary logits of a response, (b, r, V) float32 (or the head's own precision, if higher) with V =
151,936 for Qwen2.5-VL, are the largest tensors of a training step (b = 4, r = 2048: 5 GB per copy, and log_softmax,
softmax and their gradients make several copies). Projecting `chunk` tokens at a time and keeping only each token's
logprob and entropy makes the peak grow with the chunk instead. Under autograd each chunk runs inside
`torch.utils.checkpoint`, so its logits are recomputed in the backward instead of being kept from the forward; the
gradient is the same.

Pure functions over tensors: no config objects, no process groups, no device assumptions.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs_and_entropy(head: torch.nn.Module, hidden: torch.Tensor,
                                labels: torch.Tensor, temperature: float, with_entropy: bool,
                                entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(n, H) hidden, (n,) labels -> (n,) logprobs and (n,) entropy (or None): one chunk, in float32 or the head's
    precision if higher; (n, J) labels give (n, J) logprobs."""
    logits = head(hidden)  # (n, V)
    # promoted, never cast down: a 16-bit head's logits go up to float32, a float64 head's stay float64 (a cast to
    # float32 here made a float64 model's loss and gradients float32-exact only)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    lse = torch.logsumexp(logits, dim=-1)  # (n,): once for both, the vocabulary-wide pass that dominates
    if labels.dim() == 1:
        logprobs = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1) - lse  # as logprobs_from_logits
    else:  # (n, J) ids per position: their J logprobs
        logprobs = torch.gather(logits, -1, labels) - lse.unsqueeze(-1)
    entropy = None
    if with_entropy:
        grad = entropy_grad and torch.is_grad_enabled()
        with torch.set_grad_enabled(grad):  # as entropy_from_logits: logsumexp - E[logit]
            entropy = (lse if grad else lse.detach()) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)
    return logprobs, entropy


def logprobs_and_entropy(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor,
                         temperature: float = 1.0, chunk: int = 0, with_entropy: bool = False,
                         entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each label under softmax(head(hidden) / temperature), and the distribution's entropy.

    Args:
        hidden: (b, r, H) last hidden states at the positions that predict `labels`.
        head: the output projection (H -> V), e.g. the model's `lm_head`.
        labels: (b, r) long, the tokens whose logprobs are wanted; or (b, r, J): J ids per position (the sampled
            token and the teacher's top-k, for top-k distillation), whose logprobs come as (b, r, J).
        temperature: logits are divided by it (the distribution the policy sampled).
        chunk: tokens (over b * r) projected at a time; 0 = all at once. Values are those of the unchunked pass up to
            the projection's summation order (float32: within 1e-6); gradients likewise.
        with_entropy: also return the entropy.
        entropy_grad: give the entropy a graph (for an entropy bonus); otherwise it is a detached metric.

    Returns:
        (b, r) logprobs, and (b, r) entropy or None: float32, or the head's output dtype where that is wider.

    >>> head = torch.nn.Linear(4, 10, bias=False)
    >>> hidden, labels = torch.randn(2, 3, 4), torch.randint(10, (2, 3))
    >>> whole, _ = logprobs_and_entropy(hidden, head, labels)
    >>> parts, _ = logprobs_and_entropy(hidden, head, labels, chunk=2)
    >>> torch.allclose(whole, parts, atol=1e-6)
    True
    """
    b, r = labels.shape[:2]
    extra = labels.shape[2:]  # () or (J,)
    # (b * r, H): the head sees a 2-D input, so its backward makes the (V, H) weight gradient in one matmul (a
    # batched 3-D one would make one per row and sum them)
    flat_hidden = hidden.reshape(b * r, hidden.shape[-1])
    flat_labels = labels.reshape(b * r, *extra)
    if chunk <= 0 or chunk >= b * r:
        logprobs, entropy = _chunk_logprobs_and_entropy(head, flat_hidden, flat_labels, temperature, with_entropy,
                                                        entropy_grad)
        return logprobs.view(b, r, *extra), (entropy.view(b, r) if with_entropy else None)
    # Recompute each chunk's logits in the backward rather than keep them: only worth it when a backward will run.
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in head.parameters()))
    logprobs, entropy = [], []
    for start in range(0, b * r, chunk):
        part = (head, flat_hidden[start : start + chunk], flat_labels[start : start + chunk], temperature,
                with_entropy, entropy_grad)
        lp, ent = (checkpoint(_chunk_logprobs_and_entropy, *part, use_reentrant=False) if recompute
                   else _chunk_logprobs_and_entropy(*part))
        logprobs.append(lp)
        entropy.append(ent)
    return (torch.cat(logprobs).view(b, r, *extra),
            torch.cat(entropy).view(b, r) if with_entropy else None)


@torch.no_grad()
def top_logprobs(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, k: int,
                 temperature: float = 1.0, chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A frozen model's (b, r) logprobs of `labels` (b, r) under softmax(head(hidden) / temperature), and at each
    position its k largest logprobs (b, r, k) with their ids (b, r, k), largest first: what a distillation teacher
    gives for top-k forward KL. `chunk` tokens projected at a time (0 = all), as `logprobs_and_entropy`.

    >>> head = torch.nn.Linear(4, 10, bias=False)
    >>> hidden, labels = torch.randn(2, 3, 4), torch.randint(10, (2, 3))
    >>> lp, values, ids = top_logprobs(hidden, head, labels, 10)  # k = V: the whole distribution, sorted
    >>> torch.allclose(values.gather(-1, ids.argsort(-1)), torch.log_softmax(head(hidden), -1), atol=1e-6)
    True
    """
    b, r = labels.shape
    flat_hidden, flat_labels = hidden.reshape(b * r, hidden.shape[-1]), labels.reshape(b * r)
    step = chunk if 0 < chunk < b * r else max(b * r, 1)
    logprobs, values, ids = [], [], []
    for start in range(0, b * r, step):
        logits = head(flat_hidden[start:start + step])
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        lp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)  # (n, V)
        logprobs.append(lp.gather(-1, flat_labels[start:start + step].unsqueeze(-1)).squeeze(-1))
        top = lp.topk(k, dim=-1)
        values.append(top.values)
        ids.append(top.indices)
    if not logprobs:  # no position
        empty = hidden.new_zeros((b, r, k), dtype=torch.float32)
        return empty[..., 0], empty, empty.long()
    return torch.cat(logprobs).view(b, r), torch.cat(values).view(b, r, k), torch.cat(ids).view(b, r, k)
