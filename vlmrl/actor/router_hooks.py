"""The routers of a Mixture-of-Experts model: what they chose (record) and choosing for them (replay).

Each MoE decoder layer's router (`ModelFamily.experts.router_class`; transformers' `forward(hidden) -> (logits,
top-k weights, top-k ids)`) gets a forward that computes exactly what transformers computes (softmax over the
router logits in float32, the top-k of it, the top-k weights renormalised) and, by mode:

    record   keeps each layer's top-k ids of the attended tokens, per row of the batch;
    replay   uses given ids instead of its own top-k (the weights are the router's own probabilities at those ids,
             renormalised, so the router still learns), and counts where its own top-k would have differed.

Ids are kept per row and per attended token (prompt and response, in order), not per forward: a row's routing
recorded in one micro-batch layout (padded, packed, other rows beside it) replays in any other. Padding tokens
route as their own router says; their outputs are never read.

This is routing replay as verl (Megatron's `RouterReplay`, modes record / replay), slime and miles run it: the R2
variant records in the old-logprob pass and replays in the update, so the update's ratio compares the same experts;
the R3 variant takes the ids the rollout engine used (vLLM / SGLang `enable_return_routed_experts`, GPU only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F


def routers_of(model: torch.nn.Module, router_class: str) -> list[torch.nn.Module]:
    """The model's router modules of that class, in module order (= decoder layer order)."""
    return [m for m in model.modules() if type(m).__name__ == router_class]


class RouterHooks:
    """Record / replay on every router of a model (see the module's docstring). Outside `record` / `replay` the
    routers compute transformers' routing unchanged."""

    def __init__(self, model: torch.nn.Module, router_class: str):
        self.routers = routers_of(model, router_class)
        if not self.routers:
            raise ValueError(f"no {router_class} module in {type(model).__name__}: not a MoE model of this family")
        self.top_k = int(self.routers[0].top_k)
        self.num_experts = int(self.routers[0].num_experts)
        self._mode: str | None = None
        self._calls: list[torch.Tensor | None] = [None] * len(self.routers)
        """This forward's top-k ids per layer (own choice), (tokens, k)."""
        self._replay: list[torch.Tensor] | None = None
        self.changed = torch.zeros((), dtype=torch.long)
        """replay: (token, layer) pairs of attended tokens whose own top-k SET differed from the replayed one."""
        self.compared = torch.zeros((), dtype=torch.long)
        self.changed_tokens = torch.zeros((), dtype=torch.long)
        self.compared_tokens = torch.zeros((), dtype=torch.long)
        self._attended: torch.Tensor | None = None
        self._counted: list[bool] = [False] * len(self.routers)
        self._token_changed: torch.Tensor | None = None
        self._use_given = True
        self._margins: list[torch.Tensor | None] | None = None
        self._aux: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        """collect_aux: per layer (the attended tokens' router probabilities, with their graph; their own top-k)."""
        self._aux_mask: torch.Tensor | None = None
        for index, router in enumerate(self.routers):
            router.forward = partial(self._forward, index, router)

    @property
    def layers(self) -> int:
        return len(self.routers)

    def _forward(self, index: int, router: torch.nn.Module, hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, router.hidden_dim)
        logits = F.linear(hidden, router.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        own = torch.topk(probs, router.top_k, dim=-1).indices
        ids = own
        if self._mode == "replay":
            assert self._replay is not None and self._attended is not None
            given = self._replay[index].to(own.device)
            mine = own[self._attended]
            given = torch.where(given < 0, mine, given)  # -1: no recorded id, route as the router says
            if self._use_given:
                ids = own.clone()
                ids[self._attended] = given
            self._count(index, mine, given)
        elif self._mode == "record":
            self._calls[index] = own.detach()
            if self._margins is not None:
                top = torch.topk(probs, min(router.top_k + 1, probs.shape[-1]), dim=-1).values.detach()
                self._margins[index] = top[:, -2] - top[:, -1] if top.shape[-1] > router.top_k else top[:, -1]
        if self._aux is not None and index not in self._aux:  # a recomputing backward routes again: keep the first
            mask = self._aux_mask if self._aux_mask is not None else torch.ones(len(own), dtype=torch.bool)
            mask = mask.to(own.device)
            self._aux[index] = (probs[mask], own[mask])
        weights = probs.gather(-1, ids)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), ids

    def _count(self, index: int, own: torch.Tensor, given: torch.Tensor) -> None:
        """Counts each micro-batch's layer once (a recomputing backward calls the router again)."""
        if self._counted[index]:
            return
        self._counted[index] = True
        differs = (own.sort(dim=-1).values != given.sort(dim=-1).values).any(dim=-1)
        self.changed += int(differs.sum())
        self.compared += differs.numel()
        self._token_changed = differs if self._token_changed is None else self._token_changed | differs
        if all(self._counted):
            self.changed_tokens += int(self._token_changed.sum())
            self.compared_tokens += self._token_changed.numel()

    @contextmanager
    def record(self, attended: torch.Tensor, lengths: Sequence[int], margins: bool = False
               ) -> Iterator[dict]:
        """Within: forwards record. Yields {row position in the micro-batch: (layers, its attended tokens, k) ids},
        filled when the block ends. `attended`: the forward's flattened token mask (padded: attention_mask; packed:
        all ones); `lengths`: each row's attended tokens, in order. `margins`: also "margins", {row position:
        (layers, tokens) float32}, each token's k-th minus (k+1)-th router probability (how near a tie its choice
        was)."""
        out: dict = {}
        self._mode, self._calls = "record", [None] * self.layers
        self._margins = [None] * self.layers if margins else None
        try:
            yield out
            if any(c is None for c in self._calls):
                raise RuntimeError("a router did not run in the recorded forward")
            mask = attended.reshape(-1).bool().to(self._calls[0].device)
            per_layer = [c[mask].to(torch.int16).cpu() for c in self._calls]  # type: ignore[index]
            stacked = torch.stack(per_layer)  # (layers, attended tokens, k)
            for position, part in enumerate(torch.split(stacked, list(lengths), dim=1)):
                out[position] = part.clone()
            if self._margins is not None:
                gaps = torch.stack([m[mask].float().cpu() for m in self._margins])  # type: ignore[index]
                out["margins"] = dict(enumerate(torch.split(gaps, list(lengths), dim=1)))
        finally:
            self._mode, self._calls, self._margins = None, [None] * self.layers, None

    @contextmanager
    def replay(self, rows: Sequence[torch.Tensor], attended: torch.Tensor, use_given: bool = True) -> Iterator[None]:
        """Within: forwards route the attended tokens through the given experts. `rows`: each row's (layers, its
        attended tokens, k) ids, in the forward's row order, -1 where a token has none (it routes as the router
        says: an engine never runs a response's last token); `attended` as in `record`. `use_given=False`: the
        routers route as they would, only counting where they differ from the given ids (the metrics without
        replay)."""
        ids = torch.cat([r.to(torch.long) for r in rows], dim=1)  # (layers, attended tokens, k)
        mask = attended.reshape(-1).bool()
        if int(mask.sum()) != ids.shape[1]:
            raise ValueError(f"routing replay: {ids.shape[1]} recorded tokens for a forward of {int(mask.sum())}")
        self._use_given = use_given
        self._mode, self._replay, self._attended = "replay", list(ids.to(mask.device).unbind(0)), mask
        self._counted, self._token_changed = [False] * self.layers, None
        try:
            yield
        finally:
            self._mode, self._replay, self._attended = None, None, None

    def take_counts(self, total: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """Fractions of replayed (token, layer) pairs and of tokens (any layer) whose own top-k set differed from the
        replayed one, since the last call; {} when nothing was replayed. `total`: sums the four counts over the
        processes that share the update (FSDP ranks: an all-reduce, so every rank must call this), making the
        fractions the global batch's rather than an average of the ranks' fractions."""
        counters = (self.changed, self.compared, self.changed_tokens, self.compared_tokens)
        counts = torch.stack([c.detach().to(torch.float64).reshape(()) for c in counters])
        if total is not None:
            counts = total(counts)
        for counter in counters:
            counter.zero_()
        changed, compared, changed_tokens, compared_tokens = (float(c) for c in counts.cpu())
        if compared == 0:
            return {}
        return {"mismatch/routing_changed_frac": changed / compared,
                "mismatch/routing_changed_tokens_frac": changed_tokens / max(compared_tokens, 1.0)}


class AuxLoss:
    """What `collect_aux` yields: call `value()` once the forward has run."""

    def __init__(self, hooks: RouterHooks):
        self.hooks = hooks

    def value(self) -> torch.Tensor:
        """The Switch-Transformer load-balancing loss of the forward's attended tokens, as transformers'
        `load_balancing_loss_func` computes it from `output_router_logits` with an attention mask: over every MoE
        layer's tokens together, E x sum over experts of (share of top-k slots routed to the expert) x (mean router
        probability of the expert); differentiable through the router probabilities."""
        parts = self.hooks._aux or {}
        if len(parts) != self.hooks.layers:
            raise RuntimeError(f"the load-balancing loss needs every router's forward: {len(parts)} of "
                               f"{self.hooks.layers} ran")
        probs = torch.cat([parts[i][0] for i in range(self.hooks.layers)])
        chosen = torch.cat([parts[i][1] for i in range(self.hooks.layers)])
        experts = self.hooks.num_experts
        slots = F.one_hot(chosen, experts).to(probs.dtype).mean(dim=0)  # (k, E)
        return experts * (slots * probs.mean(dim=0).unsqueeze(0)).sum()


@contextmanager
def collect_aux(hooks: RouterHooks, attended: torch.Tensor | None) -> Iterator[AuxLoss]:
    """Within: the forward keeps what the load-balancing loss needs (`AuxLoss.value`). `attended`: the forward's
    flattened token mask (None: every token)."""
    hooks._aux, hooks._aux_mask = {}, None if attended is None else attended.reshape(-1).bool()
    try:
        yield AuxLoss(hooks)
    finally:
        hooks._aux, hooks._aux_mask = None, None
