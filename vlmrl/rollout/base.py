"""The rollout interface every backend implements, the options it starts from, and the deadline runner every engine
call goes through.

Contract shared by all backends (`hf`, `vllm`, `sglang`, `sglang-server`), enforced here once:
  - `generate(requests, sampling)` checks the requests (`vlmrl.rollout.requests.validate_requests`), calls the
    backend's own `_generate`, and checks its results (`check_results`): `len(requests) * sampling.n` of them,
    request-major, one logprob per token, no banned token. A backend cannot skip either check.
  - Logprobs are of the RAW model distribution: log_softmax of the model's logits over the whole vocabulary, before
    temperature, top-p/top-k and before the pad-token ban (what the trainer recomputes). Top-k lists rank the
    tokens that may be sampled (banned ids are left out) with those same raw values.
  - `score(requests, responses)` gives the raw logprob of each given response token after the same request's
    prompt, teacher-forced, and `score_top` also the top-k of the distribution at each response position
    (`vlmrl.rollout.scoring` checks what goes in and comes out).
  - Every engine call runs under `timeout_s`; a dead engine process raises `EngineDeadError` naming the backend.
  - `sleep()` frees the accelerator memory of an engine started for it (`releases_memory`); `generate`,
    `update_weights` and `update_adapter` wake what they need first.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from vlmrl.models.experts import ExpertShape, RoutingLayout
from vlmrl.models.families import ModelFamily, read_model_config
from vlmrl.rollout.config import BACKEND_SECTIONS, ENGINE_OPTIONS, SERVING_OPTIONS, RolloutConfig
from vlmrl.rollout.errors import (
    EngineDeadError,
    EngineSettingError,
    EngineTimeoutError,
    InvalidRequestError,
    RolloutError,
)
from vlmrl.rollout.requests import check_results, validate_requests
from vlmrl.rollout.scoring import ScoredResponse, check_responses, check_scores
from vlmrl.rollout.weight_group import BucketMeta, WeightGroup
from vlmrl.rollout.weights import SyncRecipe, WeightSync, checkpoint_names
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams
from vlmrl.utils.executor import DaemonExecutor, DeadlineExceeded

logger = logging.getLogger(__name__)

T = TypeVar("T")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Engine dtypes by name (`BackendOptions.resolved_dtype`)."""
ALL_MEMORY = ("weights", "kv_cache")
"""What a sleeping engine gives back, and what `wake_up` takes back (by default all of it)."""

__all__ = ["ALL_MEMORY", "DTYPES", "BackendOptions", "DeadlineRunner", "EngineDeadError", "EngineTimeoutError",
           "InvalidRequestError", "RolloutBackend", "RolloutError", "family_engine_overrides", "merged",
           "release_memory"]


# ---------------------------------------------------------------------------------------------------- options


@dataclass
class BackendOptions:
    """What a backend starts from: the run's rollout section (a backend reads its engine-neutral knobs and its own
    sub-sections, `BACKEND_SECTIONS`) plus what the run derives from its other sections."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The rollout section."""
    max_model_len: int = 4096
    """Longest prompt (expanded, one token per merged image patch) + response the engine must hold (the run's
    data.max_prompt_length + data.max_response_length)."""
    seed: int = 0
    """Engine seed (vLLM `seed`, SGLang `random_seed`, torch for hf; the run's trainer.seed); per-request seeds come
    from SamplingParams."""
    colocated: bool = False
    """The engine shares its device with a training actor: memory release (vLLM sleep mode, SGLang's memory saver)
    is then on by default on a GPU."""
    lora_rank: int = 0
    """> 0: serve LoRA adapters up to this rank (vLLM `enable_lora`), set by a run whose actor.lora syncs adapters."""
    lora_vision: bool = False
    """With lora_rank: the adapters cover the vision tower and merger too (vLLM's enable_tower_connector_lora)."""
    spmd: bool = False
    """This process is one tensor-parallel rank of an engine whose other ranks run in the other processes of its
    torch.distributed group, each building the engine and calling it alike (vLLM's `external_launcher`, verl's
    layout); set by a training worker (`vlmrl.distributed.layout.EngineLayout`)."""
    cpu_binding: str = ""
    """On a CPU at rollout.tensor_parallel_size > 1: each TP rank's cores, "|"-separated (SGLang's
    SGLANG_CPU_OMP_THREADS_BIND); empty: the machine's cores split evenly. Set by a training worker."""

    def resolved_dtype(self, family: ModelFamily | None = None, on_cuda: bool | None = None) -> str:
        """rollout.dtype; auto = bfloat16 on CUDA, on CPU the family's `cpu_engine_dtype` (Qwen3.5: bfloat16, the only
        dtype its CPU engines run) or else float32. Every backend of a run resolves alike, the hf reference too.
        `on_cuda`: where the engine runs, when that is not where this process sees a GPU (a judge on device=cpu)."""
        if self.rollout.dtype != "auto":
            return self.rollout.dtype
        if torch.cuda.is_available() if on_cuda is None else on_cuda:
            return "bfloat16"
        return (family.engines.cpu_engine_dtype if family is not None else None) or "float32"

    @classmethod
    def from_kwargs(cls, backend: str, options: dict[str, Any]) -> BackendOptions:
        """Options from flat keywords (`get_backend("vllm", path, dtype="float32", enforce_eager=True)`): the
        derived fields above, the rollout section's engine-neutral knobs and the fields of the backend's own
        sub-sections. An unknown key raises naming the backend and every key it takes."""
        derived = {f.name for f in dataclasses.fields(cls)} - {"rollout"}
        neutral = [k for k in ENGINE_OPTIONS if backend != "hf" or k not in SERVING_OPTIONS]
        sections = {name: {f.name for f in dataclasses.fields(type(getattr(RolloutConfig(), name)))}
                    for name in BACKEND_SECTIONS.get(backend, ())}
        known = derived | set(neutral) | {key for keys in sections.values() for key in keys}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"{backend}: unknown option(s) {unknown}; this backend takes {sorted(known)}")
        parts = {name: {k: v for k, v in options.items() if k in keys} for name, keys in sections.items()}
        rollout = RolloutConfig(**{k: v for k, v in options.items() if k in neutral},
                                **{name: type(getattr(RolloutConfig(), name))(**kw) for name, kw in parts.items()})
        return cls(rollout=rollout, **{k: v for k, v in options.items() if k in derived})


def release_memory(setting: bool | None, on_cuda: bool, colocated: bool) -> bool:
    """Whether an engine starts able to free its memory between rollouts (vLLM sleep mode, SGLang's memory saver):
    as set, or (null) when it runs on a GPU it shares with training."""
    return (on_cuda and colocated) if setting is None else setting


def captures_routing(rollout: RolloutConfig, backend: str, family: ModelFamily | None) -> bool:
    """Whether `backend`'s engine captures the routing of the samples it makes (`RolloutResult.routed_experts`): its
    key is on (`RolloutConfig.routing_capture`) and the model routes through experts. On a family vlmrl knows to be
    dense the key is refused before the engine starts, as at load (it would capture nothing); `family` None (a
    judge's model of no family vlmrl knows) captures nothing."""
    if family is not None and family.experts is None and rollout.routing_capture(backend):
        raise EngineSettingError(f"{backend}: " + rollout.dense_routing_capture(family.name, backend))
    return family is not None and bool(rollout.routing_capture(backend))


# ---------------------------------------------------------------------------------------------------- the interface


class RolloutBackend(abc.ABC):
    """One rollout engine behind the shared contract (see the module docstring). Use as a context manager."""

    name: str = "base"
    accepts_partial_weights: bool = False
    """`update_weights` may be given some of the weights only (the others stay): a LoRA policy's merged sync then
    sends only the adapted layers. False: every weight, every time."""
    weight_group_backends: tuple[str, ...] = ()
    """The collective transports (gloo, nccl) this engine receives weights over (`join_weight_group`); () = none:
    its weights come through `update_weights` only."""

    def __init__(self, model_path: str, options: BackendOptions):
        from vlmrl.processors.loading import load_processor

        self.model_path = model_path
        self.options = options
        self.rollout = options.rollout
        # The processor owns token ids and image geometry; the same one builds the requests.
        self.processor = load_processor(model_path)
        self.engine_pids: list[int] = []
        """The processes the engine runs in (empty when it runs in this process): watched while waiting on calls,
        and the only processes close() ends."""
        self.dtype = options.resolved_dtype(self.processor.family)
        """The dtype the engine computes in, never `auto`: what every backend starts its engine with; a backend whose
        engine reports its own dtype sets that (vLLM). A validation artifact records it, and compare's thresholds
        follow from it."""
        self.logprobs_mode = "raw_logprobs"
        """What the engine's logprobs are of: `raw_logprobs` (the contract above); vLLM sets what its engine reports
        (rollout.vllm.engine_kwargs can ask for processed_logprobs). A validation artifact records it."""
        self._logged_once: set[str] = set()
        self._checkpoint_names: set[str] | None = None
        self._expert_shape: ExpertShape | None = None
        self._routing_layout: RoutingLayout | None = None
        self._asleep: set[str] = set()  # what sleep() gave back and no wake_up took back yet (ALL_MEMORY)
        self.weights_dropped = False
        """A sleep discarded the weights (vLLM sleep level 2, SGLang's memory saver): a full weight sync must come
        before the next generate."""
        self.weight_loads = 0
        """How many weight updates (`update_weights`, `update_adapter`, or a sync that loads the engines directly)
        returned: the fit loop compares it before and after each sync to tell a sync that never reached the engine."""

    # ---- what every backend implements

    @abc.abstractmethod
    def _generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        """The engine call behind `generate`, for requests already checked; results are checked after it."""

    @abc.abstractmethod
    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None
                        ) -> None:
        """Load the weights (see `update_weights`) into an awake engine."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the engine and every process it started (only those). Safe to call twice."""

    # ---- the contract, enforced here

    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        """`len(requests) * sampling.n` results, request-major. Raises InvalidRequestError before the engine for a
        bad request, RolloutError (EngineDeadError / EngineTimeoutError) when the engine fails or returns results
        that break the contract."""
        self.check_requests(requests, sampling)
        if self.weights_dropped:
            raise RolloutError(f"{self.name}: the engine discarded its weights while asleep (sleep_level 2 or "
                               "SGLang's memory saver): sync the policy's weights before generating")
        self.wake_up()
        results = self._generate(requests, sampling)
        check_results(results, requests, sampling, self.name)
        return results

    def score(self, requests: Sequence[RolloutRequest], responses: Sequence[Sequence[int]]) -> list[list[float]]:
        """For each request, the raw logprob (the distribution `generate`'s logprobs are of) of each token of its
        response after the prompt and the response tokens before it: one forward of prompt + response on the
        engine's model, the request's images included. An empty response scores []. Raises InvalidRequestError
        before the engine for a request generate would refuse or a response it cannot score, RolloutError when the
        engine fails or answers another number of logprobs."""
        return [scored.logprobs for scored in self.score_top(requests, responses, 0)]

    def score_top(self, requests: Sequence[RolloutRequest], responses: Sequence[Sequence[int]], top_k: int
                  ) -> list[ScoredResponse]:
        """`score`'s logprobs and, per response token, the `top_k` most likely tokens {id: raw logprob} of the
        distribution at its position (the engine's prompt top-k logprobs; 0 = none), in the same one forward."""
        check_responses(requests, responses, {self.processor.image_token_id, self.processor.video_token_id},
                        self.name)
        self.check_requests(requests, SamplingParams(max_new_tokens=1), [len(r) + 1 for r in responses])
        if self.weights_dropped:
            raise RolloutError(f"{self.name}: the engine discarded its weights while asleep: sync the policy's "
                               "weights before scoring")
        self.wake_up()
        todo = [i for i, response in enumerate(responses) if len(response)]
        scores = [ScoredResponse([]) for _ in requests]
        if todo:
            chosen, given = [requests[i] for i in todo], [list(responses[i]) for i in todo]
            scored = self._score(chosen, given, top_k)
            check_scores(scored, chosen, given, top_k, self.name)
            for i, record in zip(todo, scored):
                scores[i] = record
        return scores

    def _score(self, requests: Sequence[RolloutRequest], responses: list[list[int]], top_k: int
               ) -> list[ScoredResponse]:
        """The engine call behind `score_top`, for checked requests and non-empty responses, under the deadline."""
        raise NotImplementedError(f"{self.name}: this backend cannot score given tokens")

    def generate_on_each(self, requests: Sequence[RolloutRequest], sampling: SamplingParams
                         ) -> list[list[RolloutResult]]:
        """The same requests on every engine this backend drives (one list of results per engine, engine 0 first):
        what the weight probe asks of each engine. One engine here; several for the engines of a distributed run."""
        return [self.generate(requests, sampling)]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None = None
                       ) -> None:
        """Load these weights into the engine (transformers-5 in-memory names `model.language_model.*` /
        `model.visual.*`, or the names of the model's checkpoint; mapped through the model's family), a bucket of
        rollout.sync_bucket_mb at a time, and drop every cache computed with the old ones. `names`: the names
        `named_tensors` will give, in order, for a stream read only once (`weight_sync`); None = `named_tensors` is
        read into a list of references first. A sleeping engine takes its weights' memory back first (its KV cache
        waits for the next generate, so the two are not held at once beside the trainer's)."""
        self.wake_up(("weights",))
        self._update_weights(named_tensors, names)
        self.weights_dropped = False
        self.weights_loaded()

    def sync_from_ranks(self, source: Any) -> int | None:
        """Load the weights that the training ranks `source` send themselves (`vlmrl.distributed.weight_transfer.
        WeightSource`: rank 0 broadcasts over a weight group), nothing through this process; returns the tensors
        loaded, or None when this backend does not take weights that way (the caller gathers them and calls
        `update_weights`)."""
        return None

    def weights_loaded(self) -> None:
        """Count one weight update that reached the engine (`weight_loads`)."""
        self.weight_loads += 1

    def takes_partial_weights(self) -> bool:
        """Whether `update_weights` may be given only the weights that changed: the backend loads by name
        (`accepts_partial_weights`) and holds every other weight (none was dropped by a sleep)."""
        return self.accepts_partial_weights and not self.weights_dropped

    # ---- weights through a collective group (`vlmrl.rollout.weight_group`)

    def join_weight_group(self, group: WeightGroup, rank_offset: int) -> None:
        """Join `group` with every TP rank of the engine (rank `rank_offset` + its TP rank), under the deadline;
        the sender joins as rank 0 at the same time. Raises RolloutError naming the group when the engine cannot
        (port taken, wrong world size: the rendezvous runs past group.timeout_s)."""
        if group.backend not in self.weight_group_backends:
            raise RolloutError(f"{self.name}: this backend receives no weights over a {group.backend} group "
                               f"(it takes {list(self.weight_group_backends) or 'none'})")
        self._join_weight_group(group, rank_offset)

    def begin_receive(self) -> None:
        """Open a weight load over the joined group: `receive_bucket` per bucket, then `end_receive`; together
        `update_weights` with the tensors coming over the group. A failure between begin and end leaves the engine
        unusable until a full load lands (never on mixed weights unnoticed): the error says so."""
        self.wake_up(("weights",))
        self._begin_receive()

    def receive_bucket(self, meta: BucketMeta) -> int:
        """Load the bucket rank 0 of the joined group broadcasts now (the sender broadcasts while this runs);
        returns the number of tensors loaded."""
        return self._receive_bucket(meta)

    def end_receive(self) -> None:
        """Close the load: drop every cache computed with the old weights, count one weight update."""
        self._end_receive()
        self.weights_dropped = False
        self.weights_loaded()

    def weights_checksum(self) -> str:
        """A digest of the weights as the engine holds them (its own names and layout, every TP rank's shard): two
        engines of the same kind and TP size on the same weights give the same digest, whatever path the weights
        came by. What "bitwise the same weights" is checked by where an engine's outputs are not reproducible to
        the last bit run to run (SGLang on a CPU)."""
        raise NotImplementedError(f"{self.name}: this backend reports no weights checksum")

    def leave_weight_group(self) -> None:
        """Leave the joined group (before a new one is formed); a no-op without one."""

    def _join_weight_group(self, group: WeightGroup, rank_offset: int) -> None:
        raise NotImplementedError

    def _begin_receive(self) -> None:
        raise NotImplementedError

    def _receive_bucket(self, meta: BucketMeta) -> int:
        raise NotImplementedError

    def _end_receive(self) -> None:
        raise NotImplementedError

    def serves_adapters(self) -> bool:
        """Whether `update_adapter` works: the engine was started to serve LoRA adapters (vLLM with enable_lora)."""
        return False

    def update_adapter(self, folder: str) -> None:
        """Generate under this PEFT LoRA adapter folder from now on (replacing the previous one), every cache of
        results computed under the old one dropped. Only where `serves_adapters()`."""
        if not self.serves_adapters():
            raise NotImplementedError(f"{self.name}: this backend does not serve LoRA adapters; sync merged weights")
        self.wake_up()
        self._update_adapter(folder)
        self.weights_loaded()

    def _update_adapter(self, folder: str) -> None:
        raise NotImplementedError

    # ---- memory release between rollouts

    def releases_memory(self) -> bool:
        """Whether `sleep()` frees accelerator memory (the engine was started for it)."""
        return False

    @property
    def asleep(self) -> tuple[str, ...]:
        """What the engine has given back and not taken back yet (of ALL_MEMORY); empty when awake."""
        return tuple(tag for tag in ALL_MEMORY if tag in self._asleep)

    def sleep(self) -> None:
        """Free the engine's accelerator memory (weights, KV cache) while the actor trains, where the engine was
        started for it (`releases_memory`); else a no-op, said once in the log. Idempotent."""
        if not self.releases_memory():
            if "sleep" not in self._logged_once:
                self._logged_once.add("sleep")
                logger.info("%s: the engine keeps its memory between rollouts (%s)", self.name,
                            self.why_no_release())
            return
        if self._asleep:
            return
        self.weights_dropped = self._sleep()
        self._asleep = set(ALL_MEMORY)

    def wake_up(self, tags: Sequence[str] = ALL_MEMORY) -> None:
        """Take back what `sleep()` gave back, of `tags` (weights, kv_cache); nothing to do when awake."""
        todo = [tag for tag in ALL_MEMORY if tag in tags and tag in self._asleep]
        if todo:
            self._wake_up(todo)
            self._asleep -= set(todo)

    def why_no_release(self) -> str:
        """Said once when sleep() is asked of an engine that keeps its memory."""
        return "no accelerator memory to free here"

    def _sleep(self) -> bool:
        """Give the memory back; returns whether the weights were discarded (not kept in host memory)."""
        raise NotImplementedError

    def _wake_up(self, tags: list[str]) -> None:
        raise NotImplementedError

    # ---- helpers for backends

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def sync_plan(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None = None,
                  whole: bool = False) -> WeightSync:
        """What `update_weights` loads (`weight_sync`): the names, then buckets of rollout.sync_bucket_mb in the
        engine's dtype; `whole`: one bucket."""
        return self.sync_recipe(whole).plan(named_tensors, names)

    def sync_recipe(self, whole: bool = False) -> SyncRecipe:
        """How this backend's syncs are cut (`sync_plan`), for a process that holds the weights but not the backend."""
        if self._checkpoint_names is None:
            self._checkpoint_names = checkpoint_names(self.model_path)
        return SyncRecipe(model_names=frozenset(self._checkpoint_names),
                          dtype=DTYPES[self.dtype],  # as the engine computes (a remote one's, a served one's)
                          bucket_bytes=0 if whole else int(self.rollout.sync_bucket_mb * 2**20), backend=self.name,
                          family=self.processor.family, experts=self.expert_layout())

    def expert_layout(self) -> tuple[str, ExpertShape] | None:
        """(the layout this backend loads routed experts in, the model's expert sizes) for a Mixture-of-Experts model,
        None for a dense one: the engines load the family's checkpoint layout (a transformers model its own)."""
        experts = self.processor.family.experts
        if experts is None:
            return None
        if self._expert_shape is None:  # read once: every sync asks
            self._expert_shape = ExpertShape.of(read_model_config(self.model_path))
        return experts.checkpoint_layout, self._expert_shape

    def captures_routing(self) -> bool:
        """Whether this backend's results carry the routing the engine computed (`RolloutResult.routed_experts`): a
        MoE model with the engine's capture on (rollout.vllm.capture_routing, rollout.sglang.capture_routing)."""
        return False

    def routing_layout(self) -> RoutingLayout:
        """How the engine reports this MoE model's routing (read from config.json once)."""
        if self._routing_layout is None:
            self._routing_layout = RoutingLayout.of(read_model_config(self.model_path))
        return self._routing_layout

    def sync_state(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Every tensor `update_weights` would load, at once: {checkpoint name: CPU tensor}."""
        return {k: v for bucket in self.sync_plan(named_tensors, whole=True).buckets for k, v in bucket.items()}

    def log_once(self, key: str, message: str) -> None:
        if key not in self._logged_once:
            self._logged_once.add(key)
            logger.warning(message)

    def check_requests(self, requests: Sequence[RolloutRequest], sampling: SamplingParams,
                       new_tokens: Sequence[int] | None = None) -> None:
        """Reject what no engine may receive, naming the request (see `validate_requests`; `new_tokens`: per
        request, what follows the prompt instead of sampling.max_new_tokens)."""
        validate_requests(requests, sampling, image_token_id=self.processor.image_token_id,
                          video_token_id=self.processor.video_token_id,
                          tokens_per_image=self.processor.image_token_count,
                          tokens_per_video=self.processor.video.token_count,
                          image_factor=self.processor.image_factor,
                          max_model_len=self.options.max_model_len, limit_images=self.rollout.limit_images,
                          limit_videos=self.rollout.limit_videos, backend=self.name, new_tokens=new_tokens)


# ---------------------------------------------------------------------------------------------------- engine settings


def family_engine_overrides(model_path: str, family: ModelFamily, enabled: bool, backend: str) -> dict[str, Any]:
    """The model config values an engine must start with to compute what transformers computes on `model_path`
    (`ModelFamily.engine_overrides`; empty when its config.json already says so). Logged when not empty: engines
    started outside vlmrl on the same folder would still drift.

    `enabled=False` (rollout.family_engine_settings=false, to reproduce a deployment) passes nothing and warns when
    the engine will therefore disagree with the trainer."""
    model_config = read_model_config(model_path)
    problems = family.engine_problems(model_config, backend)
    if not enabled:
        if problems:
            logger.warning("%s: rollout.family_engine_settings=false: the engine starts on %s as it is and will NOT "
                           "compute what transformers (the trainer) computes:\n  %s", backend, model_path,
                           "\n  ".join(problems))
        return {}
    overrides = family.engine_overrides(model_config)
    left = family.engine_problems(merged(model_config, overrides), backend)
    if left:  # no override settles them: this engine cannot compute what the trainer computes on this config
        raise EngineSettingError(f"{backend}: refusing to start on {model_path}: " + " ".join(left))
    if overrides:
        logger.warning("%s: %s; vlmrl starts the engine with the config override %s. Engines started outside vlmrl "
                       "on this folder would still drift: fix its config.json", backend, " ".join(problems),
                       json.dumps(overrides))
    return overrides


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` updated with `extra`, nested dicts merged key by key (`extra` wins).

    >>> merged({"text_config": {"a": 1, "b": 2}}, {"text_config": {"b": 3}, "c": 4})
    {'text_config': {'a': 1, 'b': 3}, 'c': 4}
    """
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# ---------------------------------------------------------------------------------------------------- deadlines


class DeadlineRunner:
    """Runs one backend's engine calls, one at a time, on a dedicated daemon thread, each under a deadline.

    While waiting it asks `health()` every `poll_s` (None = alive, else a sentence saying what died), so a dead
    engine process fails the call within about a second instead of at the deadline (SGLang's calls hang forever
    when its scheduler dies). After a timeout or a death every later call fails at once: the thread may still be
    stuck inside the engine. The thread is a daemon so a stuck call never blocks interpreter exit.
    """

    def __init__(self, backend: str, health: Callable[[], str | None] = lambda: None, poll_s: float = 0.5):
        self.backend = backend
        self.health = health
        self.poll_s = poll_s
        self.broken: str | None = None
        self._engine_thread = DaemonExecutor(1, f"vlmrl-{backend}-engine")

    def call(self, what: str, fn: Callable[[], T], timeout_s: float) -> T:
        """fn() on the engine thread; raises EngineDeadError / EngineTimeoutError / RolloutError naming the backend."""
        if self.broken:
            raise EngineDeadError(f"{self.backend}: cannot {what}: the engine is unusable ({self.broken}); "
                                  "close this backend and start a new one")
        self._check_health(what)
        try:
            return self._engine_thread.call(what, fn, timeout_s, check=lambda: self._check_health(what),
                                            poll_s=self.poll_s)
        except DeadlineExceeded:
            self.broken = f"{what} ran past its {timeout_s:g} s deadline"
            raise EngineTimeoutError(f"{self.backend}: {what} did not finish within {timeout_s:g} s "
                                     "(timeout_s); the engine is considered hung") from None
        except (RolloutError, InvalidRequestError):
            raise
        except Exception as err:
            self._check_health(what)
            raise RolloutError(f"{self.backend}: {what} failed: {type(err).__name__}: {err}") from err

    def _check_health(self, what: str) -> None:
        problem = self.health()
        if problem:
            self.broken = problem
            raise EngineDeadError(f"{self.backend}: cannot {what}: {problem}")

    def stop(self) -> None:
        """Let the thread end after its current job (a stuck one stays, as a daemon)."""
        self._engine_thread.shutdown(wait=False)
