"""The vLLM backend (offline `LLM`). vlmrl imports vllm here and in the two rooms beside it (`vlmrl.rollout.vllm_cpu`:
its CPU environment; `vlmrl.rollout.vllm_moe`: its MoE layers' routing capture and CPU repack), only inside the backend.

Requests go as `TokensPrompt`s with unexpanded ids and the already-resized images / sampled video frames with their
metadata (`do_sample_frames=False`: vLLM derives the same timing as the trainer). The contract's raw logprobs come
from `logprobs_mode="raw_logprobs"`, checked at start against rollout.vllm.engine_kwargs (`check_logprobs_mode`); the
pad-token ban is `bad_words` checked at start to map to one id each. The dtype and logprobs mode the engine reports
are what a validation artifact records.
Weight sync loads buckets through `WeightSyncWorkerExtension` (vLLM's own layer-wise reload split into begin / one
load per bucket / finish; only full state dicts, since a partial reload breaks the other layers), then resets the
encoder and prefix caches. Sleep mode (rollout.vllm.enable_sleep_mode) frees GPU memory while the actor trains.
docs/engines.md ("vLLM") has the measurements behind each of these.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from vlmrl.models.families import ModelFamily, read_model_config
from vlmrl.rollout.base import (
    BackendOptions,
    DeadlineRunner,
    RolloutBackend,
    captures_routing,
    family_engine_overrides,
    merged,
    release_memory,
)
from vlmrl.rollout.config import even_binding
from vlmrl.rollout.errors import EngineSettingError, InvalidRequestError, RolloutError
from vlmrl.rollout.logs import route_engine_logs
from vlmrl.rollout.requests import sample_seed, top_allowed
from vlmrl.rollout.scoring import ScoredResponse, response_tail, response_top_tail
from vlmrl.rollout.vllm_cpu import cpu_env, name_cpu_shared_memory
from vlmrl.rollout.vllm_moe import RoutingCaptureExtension, repack_cpu_experts_on_reload
from vlmrl.rollout.vllm_weight_group import VLLMWeightGroup, WeightGroupExtension
from vlmrl.rollout.weights import checkpoint_names
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams
from vlmrl.utils.processes import env_override, is_alive, kill_tree

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "vlmrl.rollout.vllm.WeightSyncWorkerExtension"


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM 0.32 accepts."""
SHUTDOWN_S = 10.0
"""The deadline of the engine core's own shutdown in `close` (then its processes are killed)."""


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class WeightSyncWorkerExtension(RoutingCaptureExtension, WeightGroupExtension):
    """Mixed into vLLM's worker class (`worker_extension_cls`, with the routing capture of
    `vlmrl.rollout.vllm_moe.RoutingCaptureExtension` and the weight group's receiving side,
    `vlmrl.rollout.vllm_weight_group.WeightGroupExtension`); `self` is the worker.

    A sync is begin, one load per bucket, finish: vLLM's own in-place reload (`reload_weights`) split into its three
    steps, so that the weights can arrive a bucket at a time. Begin puts every layer back on the meta device with
    its loaders deferred; each layer is rebuilt (and repacked for the CPU GEMM) once all of its weights have come,
    whichever buckets they came in; finish restores what no bucket held (derived buffers) and rebuilds the rest."""

    def vlmrl_begin_reload(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        model = self.get_model()
        _quiet_derived_buffer_warnings(model)
        repack_cpu_experts_on_reload(model)
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)

    def vlmrl_load_bucket(self, blob: bytes) -> int:
        from safetensors.torch import load
        from vllm.config import set_current_vllm_config

        state = load(blob)
        with set_current_vllm_config(self.vllm_config):
            self.get_model().load_weights(iter(state.items()))
        return len(state)

    def vlmrl_finish_reload(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model = self.get_model()
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
        for head in _tied_heads(model):
            # A tied lm_head shares the embedding's weight, so the reload gives it nothing to load and skips its
            # post-load step; on CPU that step packs a private copy of the weight for the GEMM (`cpu_linear`), which
            # would keep computing logits with the old embedding. Rebuild it (on CUDA the step is a no-op).
            head.quant_method.process_weights_after_loading(head)
        # what the worker's own reload_weights resets after a reload
        self.model_runner.reset_lora_state()
        self.model_runner.reset_encoder_cache()
        self.model_runner.reset_mm_cache()


def _tied_heads(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's lm_head layers whose weight is an input embedding's (tie_word_embeddings: Qwen2.5-VL-3B)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embeddings = {m.weight.data_ptr() for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    return [m for m in model.modules() if isinstance(m, ParallelLMHead) and m.weight.data_ptr() in embeddings]


class _DerivedBufferFilter(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" reload warning for layer classes that hold only buffers, and
    for a tied lm_head.

    Such layers (rotary cos/sin caches, the fused image mean/std) have nothing in a checkpoint; vLLM puts their
    values back as they were, which is right, but warns on every sync. A tied lm_head's weight is the embedding's,
    loaded through the embedding (and its GEMM rebuilt after the reload). Any other layer class with parameters keeps
    its warning.
    """

    def __init__(self, classes: set[str]):
        super().__init__()
        self.classes = classes

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.endswith(": Failed to load weights") and message.split(":", 1)[0] in self.classes)


def _quiet_derived_buffer_warnings(model: torch.nn.Module) -> None:
    """Installs (once per process) the filter for the model's buffer-only layer classes."""
    reload_logger = logging.getLogger(RELOAD_LOGGER)
    if any(isinstance(f, _DerivedBufferFilter) for f in reload_logger.filters):
        return
    with_params, with_buffers = set(), set()
    for module in model.modules():
        name = type(module).__name__
        if any(True for _ in module.parameters(recurse=False)):
            with_params.add(name)
        elif any(True for _ in module.buffers(recurse=False)):
            with_buffers.add(name)
    tied = {type(m).__name__ for m in _tied_heads(model)}
    reload_logger.addFilter(_DerivedBufferFilter((with_buffers - with_params) | tied))


def engine_kwargs(model_path: str, options: BackendOptions, family: ModelFamily | None, on_cuda: bool
                  ) -> tuple[dict[str, Any], dict[str, str]]:
    """(`vllm.LLM(...)` keyword arguments, environment variables to set around its construction) for a backend's
    options: the rollout section's neutral knobs, rollout.vllm and what the run derives. `family` None: a model of
    no family vlmrl knows (a judge's), started as its config.json says. Pure: what a run config sets can be checked
    without starting the engine."""
    r, v = options.rollout, options.rollout.vllm
    dtype = options.resolved_dtype(family)
    if not on_cuda and family is not None:
        problems = family.cpu_engine_problems(read_model_config(model_path), "vllm", dtype)
        if problems:
            raise EngineSettingError("vllm: " + " ".join(problems))
    kwargs: dict[str, Any] = dict(
        model=model_path, dtype=dtype, max_model_len=options.max_model_len, seed=options.seed,
        enforce_eager=(not on_cuda) if v.enforce_eager is None else v.enforce_eager,
        limit_mm_per_prompt={"image": r.limit_images, "video": r.limit_videos}, logprobs_mode="raw_logprobs",
        mm_processor_kwargs={"do_sample_frames": False},
        max_num_batched_tokens=max(v.max_num_batched_tokens, options.max_model_len),
        enable_prefix_caching=v.enable_prefix_caching, tensor_parallel_size=r.tensor_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization, worker_extension_cls=WORKER_EXTENSION,
        enable_sleep_mode=release_memory(v.enable_sleep_mode, on_cuda, options.colocated),
    )
    if options.spmd:  # one TP rank in each training worker's process, through the trainer's own process group
        kwargs["distributed_executor_backend"] = "external_launcher"
    elif r.tensor_parallel_size > 1:  # an engine of its own (a rollout worker's): vLLM starts its TP processes
        kwargs["distributed_executor_backend"] = "mp"
    if captures_routing(r, "vllm", family) and on_cuda:
        kwargs["enable_return_routed_experts"] = True  # its V2 model runner's capture; on a CPU: _generate_routed
    if options.lora_rank > 0:
        rank = next((x for x in VLLM_LORA_RANKS if x >= options.lora_rank), None)
        if rank is None:
            raise EngineSettingError(f"vllm: LoRA rank {options.lora_rank} > {VLLM_LORA_RANKS[-1]}, the largest vLLM "
                                     "serves; sync merged weights (actor.lora.sync=merged)")
        kwargs.update(enable_lora=True, max_lora_rank=rank, max_loras=1,
                      enable_tower_connector_lora=options.lora_vision)
    overrides = family_engine_overrides(model_path, family, r.family_engine_settings, "vllm") if family else {}
    extra = dict(v.engine_kwargs)
    if overrides or "hf_overrides" in extra:  # the user's own overrides merge over the family's
        kwargs["hf_overrides"] = merged(overrides, extra.pop("hf_overrides", {}))
    kwargs.update(extra)
    env = {} if v.multiprocess is None else {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if v.multiprocess else "0"}
    if kwargs.get("distributed_executor_backend") == "mp":
        # measured on CPU with the engine core in a process of its own; each TP rank's cores named (vLLM refuses
        # more CPU TP ranks than NUMA nodes otherwise; an explicit value in the environment wins)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        if not on_cuda and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            env["VLLM_CPU_OMP_THREADS_BIND"] = options.cpu_binding or even_binding(r.tensor_parallel_size,
                                                                                  os.cpu_count() or 1)
    if not on_cuda:
        env = {**cpu_env(v), **env}
    return kwargs, env


LOGITS_MODES = ("raw_logits", "processed_logits")
"""vLLM logprobs modes whose values are logits, not logprobs: refused for a rollout."""


def check_logprobs_mode(mode: str) -> None:
    """The rollout contract is raw logprobs (`logprobs_mode="raw_logprobs"`, what `engine_kwargs` sets);
    rollout.vllm.engine_kwargs can replace it, so the mode the engine will start with is checked here, as SGLang's
    backend probes its own at start. Logits modes are refused; processed_logprobs starts with a warning: it is how
    compare shows what such an engine does to the logprobs (cause `processed_logprobs`), and training on it is
    wrong in the ways the warning names."""
    if mode in LOGITS_MODES:
        raise EngineSettingError(f"vllm: rollout.vllm.engine_kwargs.logprobs_mode={mode} makes the engine return "
                                 "logits, not logprobs; the trainer, rollout correction and compare read raw "
                                 "logprobs: remove the key")
    if mode == "processed_logprobs":
        logger.warning(
            "vllm: rollout.vllm.engine_kwargs.logprobs_mode=processed_logprobs replaces the raw logprobs vlmrl asks "
            "for: the engine returns logprobs of the distribution it samples from (temperature, the image/video "
            "placeholder ban, top-k/top-p), not the raw model's. Old logprobs taken from the engine, rollout "
            "correction and mismatch/* are then off by that processing, and compare names the samples "
            "processed_logprobs. Remove the key for training")


class VLLMBackend(VLLMWeightGroup, RolloutBackend):
    """vLLM's offline engine; every call on one engine thread under a deadline."""

    name = "vllm"

    def __init__(self, model_path: str, options: BackendOptions):
        super().__init__(model_path, options)
        self.on_cuda = torch.cuda.is_available()
        self._runner = DeadlineRunner(self.name, self._health)
        self.llm = None
        try:
            self.llm = self._runner.call("start the engine", self._start, self.rollout.start_timeout_s)
            self._bad_words = self._ban_texts()
        except BaseException:
            self.close()  # a failed start must not leave the engine core process behind
            raise
        self._checkpoint_names = checkpoint_names(model_path)  # what update_weights must receive, exactly
        self.stop_ids = set(self.processor.eos_token_ids)
        self._lora_request = None  # the adapter requests generate under (update_adapter), None = the base weights

    def _start(self):
        kwargs, env = engine_kwargs(self.model_path, self.options, self.processor.family, self.on_cuda)
        check_logprobs_mode(kwargs["logprobs_mode"])  # before vLLM is even imported: a refusal costs no start-up
        route_engine_logs("vllm", os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))  # before vLLM configures its logging
        from vllm import LLM

        if self.options.spmd and not self.on_cuda:
            name_cpu_shared_memory()
        self.sleep_mode = kwargs["enable_sleep_mode"]
        # Read by vLLM when the engine is built (the CPU KV cache size: for the process), so set around that only.
        if "VLLM_CPU_KVCACHE_SPACE" in env:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = env.pop("VLLM_CPU_KVCACHE_SPACE")
        with env_override(env):
            try:
                llm = LLM(**kwargs)
            except ValueError as err:
                if self.sleep_mode and "Sleep mode is not supported" in str(err):
                    raise EngineSettingError(
                        "rollout.vllm.enable_sleep_mode=true: vLLM says 'Sleep mode is not supported on current "
                        "platform' (it has sleep mode on CUDA only); set it to null (on where the engine shares a GPU "
                        "with training) or false") from err
                raise
        manager = getattr(getattr(llm.llm_engine.engine_core, "resources", None), "engine_manager", None)
        self.engine_pids = [p.pid for p in getattr(manager, "processes", [])]
        # What the engine reports, not what was asked: the artifact's header and compare's thresholds read these.
        engine = llm.llm_engine.model_config
        self.dtype = str(engine.dtype).removeprefix("torch.")
        self.logprobs_mode = str(engine.logprobs_mode)
        logger.info("vllm: engine up on %s (%s, %s%s)", self.model_path, self.dtype,
                    f"engine core process(es) {self.engine_pids}" if self.engine_pids else "in-process",
                    ", sleep mode" if self.sleep_mode else "")
        return llm

    def _health(self) -> str | None:
        """Engine core processes (multiprocess mode) must be alive; in-process there is none to lose."""
        for pid in self.engine_pids:
            if not is_alive(pid):
                return f"the vLLM engine core process (pid {pid}) has exited"
        return None

    def _ban_texts(self) -> dict[int, str]:
        """{token id: its text} for vLLM's bad_words, each checked to tokenize back to exactly that one id."""
        tokenizer = self.processor.tokenizer
        texts = {}
        for token_id in self.processor.banned_token_ids:
            text = tokenizer.decode([token_id])
            if tokenizer.encode(text, add_special_tokens=False) != [token_id]:
                raise RuntimeError(f"vllm: cannot ban token {token_id}: its text {text!r} does not tokenize back to "
                                   "that single id")
            texts[token_id] = text
        return texts

    # ------------------------------------------------------------------------------------------------ generate

    def _generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        if self._per_sample_routing():
            return self._generate_routed(requests, sampling)
        from vllm import SamplingParams as VLLMSampling

        draws = 1 if sampling.greedy else sampling.n  # greedy samples are identical: compute one, repeat it
        prompts, params = [], []
        for position, request in enumerate(requests):
            prompts.append(self._prompt(request))
            params.append(VLLMSampling(
                n=draws, temperature=sampling.temperature, top_p=sampling.top_p, top_k=max(sampling.top_k, 0),
                max_tokens=sampling.max_new_tokens, seed=sample_seed(sampling, position),
                stop_token_ids=list(sampling.stop_token_ids), bad_words=self._bad_words_for(request),
                logprobs=sampling.top_logprobs + len(request.banned_token_ids) if sampling.top_logprobs else 0,
                detokenize=False, skip_special_tokens=False,
            ))
        lora = self._lora_request
        outputs = self._runner.call(f"generate {len(requests)} requests",
                                    lambda: self.llm.generate(prompts, params, use_tqdm=False, lora_request=lora),
                                    self.rollout.timeout_s)
        return [result for request, output in zip(requests, outputs) for result in self._results(request, output,
                                                                                                 sampling)]

    def _prompt(self, request: RolloutRequest, extra_ids: Sequence[int] = ()):
        """The request as vLLM takes it: unexpanded ids (+ `extra_ids`) and its images and videos."""
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids) + list(extra_ids))
        data: dict = {}
        if request.images:
            data["image"] = list(request.images)
        if request.videos:
            data["video"] = [(v.frames, v.metadata()) for v in request.videos]
        if data:
            prompt["multi_modal_data"] = data
        return prompt

    def _score(self, requests: Sequence[RolloutRequest], responses: list[list[int]], top_k: int
               ) -> list[ScoredResponse]:
        """prompt + response as the prompt of a one-token generation with `prompt_logprobs=top_k` (each prompt
        token's own logprob, and the top_k of its position, by vLLM's rank): the response's are the last
        len(response) of them. vLLM computes prompt logprobs as log_softmax of the raw logits in both logprobs modes
        (no sampling processor touches prompt tokens), and a request that asks for them reads nothing from the prefix
        cache. top_k is bounded by the engine's max_logprobs (vLLM's default 20; an engine teacher raises it)."""
        from vllm import SamplingParams as VLLMSampling

        prompts = [self._prompt(request, response) for request, response in zip(requests, responses)]
        params = VLLMSampling(max_tokens=1, temperature=0.0, prompt_logprobs=top_k, detokenize=False)
        lora = self._lora_request
        outputs = self._runner.call(f"score {len(requests)} responses",
                                    lambda: self.llm.generate(prompts, params, use_tqdm=False, lora_request=lora),
                                    self.rollout.timeout_s)
        scores = []
        for request, response, output in zip(requests, responses, outputs):
            ids = list(output.prompt_token_ids)  # expanded
            if ids[len(ids) - len(response):] != response:
                raise RolloutError(f"vllm: request {request.uid}: the engine's prompt does not end with the response")
            what = f"request {request.uid}"
            entries = [None if pos is None else pos[t].logprob for pos, t in zip(output.prompt_logprobs, ids)]
            top = []
            if top_k:  # a position's entries are its top_k plus the prompt's own token, wherever that ranks
                tops = [None if pos is None else {t: lp.logprob for t, lp in pos.items() if lp.rank <= top_k}
                        for pos in output.prompt_logprobs]
                top = response_top_tail(tops, response, self.name, what)
            scores.append(ScoredResponse(response_tail(entries, response, self.name, what), top))
        return scores

    def _bad_words_for(self, request: RolloutRequest) -> list[str] | None:
        missing = [t for t in request.banned_token_ids if t not in self._bad_words]
        if missing:
            raise InvalidRequestError(f"vllm: request {request.uid}: cannot ban token ids {missing} (only the "
                                      f"processor's {sorted(self._bad_words)} are prepared)")
        return [self._bad_words[t] for t in request.banned_token_ids] or None

    def _results(self, request: RolloutRequest, output, sampling: SamplingParams) -> list[RolloutResult]:
        completions = sorted(output.outputs, key=lambda c: c.index)
        results = []
        for i in range(sampling.n):
            c = completions[i % len(completions)]
            ids = list(c.token_ids)
            positions = [c.logprobs[p] for p in range(len(ids))]
            tops = None
            if sampling.top_logprobs:
                tops = [top_allowed({t: lp.logprob for t, lp in pos.items()}, sampling.top_logprobs,
                                    request.banned_token_ids) for pos in positions]
            routed = getattr(c, "routed_experts", None)  # enable_return_routed_experts (GPU): (tokens, layers, k)
            results.append(RolloutResult(
                uid=request.uid, sample_index=i, response_ids=ids,
                response_logprobs=[pos[t].logprob for pos, t in zip(positions, ids)],
                finish_reason=c.finish_reason if c.finish_reason in ("stop", "length") else "abort",
                top_logprobs=tops,
                routed_experts=None if routed is None else self.routing_layout().from_engine(routed, "vllm")))
        return results

    # ------------------------------------------------------------------------------------------------ weights

    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None
                        ) -> None:
        from safetensors.torch import save

        sync = self.sync_plan(named_tensors, names)
        missing, unknown = sorted(self._checkpoint_names - sync.names), sorted(sync.names - self._checkpoint_names)
        if missing or unknown:
            # vLLM's reload path re-processes whole layers: one given partly is left broken, and so is the model.
            raise ValueError(f"vllm: update_weights needs exactly the model's {len(self._checkpoint_names)} weights: "
                             f"{len(missing)} missing (e.g. {missing[:3]}), {len(unknown)} unknown "
                             f"(e.g. {unknown[:3]})")
        timeout = self.rollout.timeout_s
        self._runner.call("begin the weight update", lambda: self.llm.collective_rpc("vlmrl_begin_reload"), timeout)
        count = 0
        try:
            for bucket in sync.buckets:
                blob = save(bucket)  # safetensors bytes survive vLLM's IPC; tensors would arrive as lists
                del bucket  # (and the blob below): host memory holds one bucket while the next is read
                count += self._load_bucket(blob)
                del blob
        except BaseException as err:
            # some layers already hold new weights and the others wait on the meta device: unusable
            self._runner.broken = f"a weight update failed half-way ({type(err).__name__}: {err})"
            raise

        self._runner.call("finish the weight update", self._finish_reload, timeout)
        logger.debug("vllm: loaded %d tensors; encoder and prefix caches reset", count)  # every sync: DEBUG

    def _finish_reload(self) -> None:
        self.llm.collective_rpc("vlmrl_finish_reload")
        # Images already seen would otherwise reuse vision embeddings (and prompts their KV) of the old weights.
        self.llm.llm_engine.reset_encoder_cache()
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("reset_prefix_cache() refused (requests still running?)")

    def generate_with_routing(self, requests: Sequence[RolloutRequest], sampling: SamplingParams
                              ) -> list[tuple[RolloutResult, torch.Tensor]]:
        """A MoE model's results with the routing the engine computed for them, as (result, (MoE layers, expanded
        prompt + response - 1 tokens, k) expert ids) - every token the engine ran; the last sampled one it never
        runs. For comparing the engine's routing with the trainer's (`vlmrl.alignment.routing`). On a GPU the
        engine must have started with rollout.vllm.capture_routing (vLLM's own `enable_return_routed_experts` is
        an engine setting); on a CPU the routers are hooked for this call (`_generate_routed`)."""
        if self.processor.family.experts is None:
            raise ValueError(f"vllm: {self.processor.family.name} is not a Mixture-of-Experts model: no routing")
        if self.on_cuda and not self.captures_routing():
            raise ValueError("vllm: the engine returns routed experts only when started with "
                             "rollout.vllm.capture_routing=true (enable_return_routed_experts)")
        self._force_routing = True
        try:
            results = self.generate(requests, sampling)
        finally:
            self._force_routing = False
        return [(result, result.routed_experts) for result in results]

    def captures_routing(self) -> bool:
        return captures_routing(self.rollout, self.name, self.processor.family)

    def _per_sample_routing(self) -> bool:
        """The CPU capture (`_generate_routed`): vLLM's own needs its V2 model runner, which needs Triton (a GPU).
        `generate_with_routing` forces it (on a MoE model only) for a call without the run's capture."""
        return ((self.captures_routing() or getattr(self, "_force_routing", False)) and not self.on_cuda
                and not getattr(self, "_capturing", False))

    def _generate_routed(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        """Every sample alone (n = 1, seeded as the batch's sample would be; the prefix cache reset so that every
        prompt token is computed), its routing captured from vLLM's own routers (`RoutingCaptureExtension`) into
        `RolloutResult.routed_experts`. Slower than a batch: for CPU tests, compare and routing replay from the
        engine (rollout.vllm.capture_routing); in eager mode only (a captured CUDA graph calls no Python hook)."""
        from safetensors.torch import load

        timeout = self.rollout.timeout_s
        layers = self._runner.call("capture routing", lambda: self.llm.collective_rpc("vlmrl_capture_routing",
                                                                                       args=(True,)), timeout)[0]
        if not layers:
            raise RuntimeError("vllm: no MoE router to capture in the engine's model")
        self._capturing = True
        results: list[RolloutResult] = []
        try:
            for position, request in enumerate(requests):
                base = sample_seed(sampling, position)
                draws = 1 if sampling.greedy else sampling.n
                drawn = []
                for i in range(draws):
                    one = dataclasses.replace(sampling, n=1, seed=None if base is None else base + i)
                    self._runner.call("reset the prefix cache", self.llm.reset_prefix_cache, timeout)
                    self._runner.call("clear the routing", lambda: self.llm.collective_rpc("vlmrl_take_routing"),
                                      timeout)
                    (result,) = self._generate([request], one)
                    blob = self._runner.call("read the routing",
                                             lambda: self.llm.collective_rpc("vlmrl_take_routing")[0], timeout)
                    drawn.append(dataclasses.replace(result, routed_experts=load(blob)["routing"].to(torch.long)))
                results += [dataclasses.replace(drawn[i % draws], sample_index=i) for i in range(sampling.n)]
        finally:
            self._capturing = False
            self._runner.call("stop capturing routing",
                              lambda: self.llm.collective_rpc("vlmrl_capture_routing", args=(False,)), timeout)
        return results

    def serves_adapters(self) -> bool:
        return self.options.lora_rank > 0

    def _update_adapter(self, folder: str) -> None:
        """Serve this PEFT adapter folder from now on: loaded under a new id (vLLM caches adapters by id), the
        previous one removed, then the encoder cache (vision embeddings of a tower adapter) and the prefix cache
        (KV under the old adapter) reset."""
        from vllm.lora.request import LoRARequest

        old = self._lora_request
        new = LoRARequest(f"vlmrl-{(old.lora_int_id if old else 0) + 1}", (old.lora_int_id if old else 0) + 1, folder)

        def run() -> None:
            if not self.llm.llm_engine.add_lora(new):
                raise RuntimeError(f"add_lora refused the adapter {folder}")
            if old is not None:
                self.llm.llm_engine.remove_lora(old.lora_int_id)
            self.llm.llm_engine.reset_encoder_cache()
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("reset_prefix_cache() refused (requests still running?)")

        self._runner.call("load a LoRA adapter", run, self.rollout.timeout_s)
        self._lora_request = new
        logger.debug("vllm: serving LoRA adapter %s (id %d); encoder and prefix caches reset", folder,
                     new.lora_int_id)

    def _load_bucket(self, blob: bytes) -> int:
        return self._runner.call("load a weight bucket",
                                 lambda: self.llm.collective_rpc("vlmrl_load_bucket", args=(blob,)),
                                 self.rollout.timeout_s)[0]

    def releases_memory(self) -> bool:
        return self.sleep_mode

    def why_no_release(self) -> str:
        return "rollout.vllm.enable_sleep_mode is off" + ("" if self.on_cuda else " (CPU)")

    def _sleep(self) -> bool:
        level = self.rollout.vllm.sleep_level
        self._runner.call(f"sleep (level {level})", lambda: self.llm.sleep(level=level), self.rollout.timeout_s)
        return level == 2

    def _wake_up(self, tags: list[str]) -> None:
        self._runner.call(f"wake up ({', '.join(tags)})", lambda: self.llm.wake_up(tags=tags), self.rollout.timeout_s)

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None and not self._runner.broken:
            try:
                # normally well under a second; it once hung to a 60 s deadline late in a full test run, and
                # whatever is left is killed below anyway
                self._runner.call("shut down", llm.llm_engine.engine_core.shutdown, SHUTDOWN_S)
            except Exception as err:  # noqa: BLE001 - closing must not raise over a dying engine
                logger.warning("vllm: shutdown: %s", err)
        for pid in self.engine_pids:  # only these processes (and their children), if still there
            kill_tree(pid, grace_s=0)
        self._runner.stop()

