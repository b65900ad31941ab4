"""The vLLM backend (offline `LLM`): the only module of vlmrl that imports vllm, and only inside the backend.

Inputs: `TokensPrompt(prompt_token_ids=<unexpanded ids>, multi_modal_data={"image": [resized PIL images],
"video": [(frames, metadata)]})`; vLLM expands each `<|image_pad|>` / `<|video_pad|>` itself. A video is the request's
sampled frames (T, H, W, 3) uint8 with their metadata (source fps, total frames, sampled indices, duration: vLLM
refuses a bare array), and the engine runs with `mm_processor_kwargs={"do_sample_frames": False}`, so it samples
nothing and its processor derives second_per_grid_ts (Qwen2/2.5-VL) or the `<x.x seconds>` timestamps it expands
each video into (Qwen3-VL) from the same metadata as the trainer.
Logprobs: the engine runs with `logprobs_mode="raw_logprobs"`: log_softmax of the logits before any processing
(temperature, top-p/top-k, bad words), i.e. the raw model distribution of the vlmrl contract.
Banned tokens: `bad_words` holding each banned token's text; it is checked at start that each text tokenizes back
to exactly that one id, so the ban is an unconditional -inf on it.
Seeds: sample i of the request at batch position j uses `seed + j * n + i` (vLLM adds i itself).
Weight sync: in buckets of rollout.sync_bucket_mb, each as safetensors bytes (they survive vLLM's IPC; tensors would
arrive as lists), through `WeightSyncWorkerExtension`: begin, one load per bucket, finish: the three steps of the
worker's own in-place `reload_weights` (after start-up a plain `model.load_weights` fails on CPU: linear weights are
repacked), so a layer whose weights span two buckets is rebuilt when its last one comes. Then the encoder cache
(vision embeddings) and the prefix cache (KV of old weights) are reset. vLLM's per-sync warning "Failed to load weights" for layers that hold only
derived buffers (rotary caches, image mean/std: nothing in a checkpoint, values kept) is filtered out. Only full
state dicts are accepted: a partial reload was measured to leave the engine's other layers broken (even a later full
reload did not restore them).
Engine settings: where the model's config.json lacks what its family needs for the engine to compute what
transformers computes (Qwen3-VL's `mrope_interleaved`), the engine starts with them as `hf_overrides`.
LoRA (`max_lora_rank` > 0): the engine serves one PEFT adapter at a time (`enable_lora`, tower/connector LoRA with
`tower_connector_lora`); `update_adapter` loads a new one under a new id, removes the old and resets the encoder and
prefix caches, and every request is generated under it (a LoRA policy's adapter sync, `vlmrl.actor.lora.LoraSync`).
On CPU: in-process by default (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, ~3 s start); sleep mode is not supported there.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from vlmrl.rollout.base import (
    DeadlineRunner,
    InvalidRequestError,
    RolloutBackend,
    RolloutOptions,
    assert_nothing_banned,
    checkpoint_names,
    family_engine_overrides,
    merged,
    sample_seed,
    top_allowed,
)
from vlmrl.rollout.config import ServingEngineOptions
from vlmrl.rollout.logs import route_engine_logs
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams
from vlmrl.utils.processes import env_override, is_alive, kill_tree

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "vlmrl.rollout.vllm.WeightSyncWorkerExtension"


@dataclass
class VLLMOptions(ServingEngineOptions, RolloutOptions):
    """Options of the `vllm` backend (names as in verl/EasyR1 and vLLM's own arguments). On CPU, the KV cache is
    cpu_kv_cache_gb instead of a share of gpu_memory_utilization."""

    enforce_eager: bool | None = None
    """Disable CUDA graphs; None = True on CPU, False on CUDA."""
    max_num_batched_tokens: int = 16384
    """Tokens per engine step. Large on purpose: vLLM-CPU raises 'CPU Generator does not use offset' when a seeded
    request's prefill is split across steps."""
    enable_prefix_caching: bool = True
    """Reuse KV of shared prompt prefixes (the n samples of a prompt); reset after every weight update."""
    enable_sleep_mode: bool = False
    """Let sleep()/wake_up() free and restore GPU memory between rollouts (CUDA only; vLLM refuses it on CPU)."""
    cpu_kv_cache_gb: float = 1.0
    """CPU only: KV cache size in GiB (sets VLLM_CPU_KVCACHE_SPACE unless it is already set)."""
    multiprocess: bool | None = None
    """Run the engine core in its own process; None = vLLM's default (VLLM_ENABLE_V1_MULTIPROCESSING)."""
    max_lora_rank: int = 0
    """> 0: start the engine with LoRA serving (enable_lora, one adapter at a time) for adapters up to this rank
    (rounded up to a rank vLLM accepts), so a LoRA policy syncs its adapter instead of merged weights; 0 = off.
    Set by the run when actor.lora syncs adapters."""
    tower_connector_lora: bool = False
    """With max_lora_rank: let adapters cover the vision tower and merger too (vLLM's enable_tower_connector_lora;
    actor.lora.vision)."""


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The max_lora_rank values vLLM 0.32 accepts."""


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class WeightSyncWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); `self` is the worker.

    A sync is begin, one load per bucket, finish: vLLM's own in-place reload (`reload_weights`) split into its three
    steps, so that the weights can arrive a bucket at a time. Begin puts every layer back on the meta device with
    its loaders deferred; each layer is rebuilt (and repacked for the CPU GEMM) once all of its weights have come,
    whichever buckets they came in; finish restores what no bucket held (derived buffers) and rebuilds the rest."""

    def vlmrl_begin_reload(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        model = self.get_model()
        _quiet_derived_buffer_warnings(model)
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


class VLLMBackend(RolloutBackend):
    """vLLM's offline engine; every call on one engine thread under a deadline."""

    name = "vllm"
    options_class = VLLMOptions

    def __init__(self, model_path: str, options: VLLMOptions):
        super().__init__(model_path, options)
        self.on_cuda = torch.cuda.is_available()
        if options.enable_sleep_mode and not self.on_cuda:
            raise ValueError("vllm: enable_sleep_mode needs CUDA (vLLM refuses it on CPU); set it to false")
        self._runner = DeadlineRunner(self.name, self._health)
        try:
            self.llm = self._runner.call("start the engine", self._start, options.start_timeout_s)
            self._bad_words = self._ban_texts()
        except BaseException:
            self.close()  # a failed start must not leave the engine core process behind
            raise
        self._checkpoint_names = checkpoint_names(model_path)  # what update_weights must receive, exactly
        self.stop_ids = set(self.processor.eos_token_ids)
        self._sleeping = False
        self._lora_request = None  # the adapter requests generate under (update_adapter), None = the base weights

    def _start(self):
        route_engine_logs("vllm", os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))  # before vLLM configures its logging
        from vllm import LLM

        o = self.options
        if not self.on_cuda:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{o.cpu_kv_cache_gb:g}")
        kwargs = dict(
            model=self.model_path, dtype=o.resolved_dtype(), max_model_len=o.max_model_len, seed=o.seed,
            enforce_eager=(not self.on_cuda) if o.enforce_eager is None else o.enforce_eager,
            limit_mm_per_prompt={"image": o.limit_images, "video": o.limit_videos}, logprobs_mode="raw_logprobs",
            mm_processor_kwargs={"do_sample_frames": False},
            max_num_batched_tokens=max(o.max_num_batched_tokens, o.max_model_len),
            enable_prefix_caching=o.enable_prefix_caching, tensor_parallel_size=o.tensor_parallel_size,
            gpu_memory_utilization=o.gpu_memory_utilization, worker_extension_cls=WORKER_EXTENSION,
        )
        if o.enable_sleep_mode:
            kwargs["enable_sleep_mode"] = True
        if o.max_lora_rank > 0:
            rank = next((r for r in VLLM_LORA_RANKS if r >= o.max_lora_rank), None)
            if rank is None:
                raise ValueError(f"vllm: LoRA rank {o.max_lora_rank} > {VLLM_LORA_RANKS[-1]}, the largest vLLM serves; "
                                 "sync merged weights (actor.lora.sync=merged)")
            kwargs.update(enable_lora=True, max_lora_rank=rank, max_loras=1,
                          enable_tower_connector_lora=o.tower_connector_lora)
        overrides = family_engine_overrides(self.model_path, self.processor.family, o.family_engine_settings,
                                            self.name)
        extra = dict(o.engine_kwargs)
        if overrides or "hf_overrides" in extra:  # the user's own overrides merge over the family's
            kwargs["hf_overrides"] = merged(overrides, extra.pop("hf_overrides", {}))
        kwargs.update(extra)
        # Read by vLLM when the engine is built, so set only around that.
        env = {} if o.multiprocess is None else {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if o.multiprocess else "0"}
        with env_override(env):
            llm = LLM(**kwargs)
        manager = getattr(getattr(llm.llm_engine.engine_core, "resources", None), "engine_manager", None)
        self.engine_pids = [p.pid for p in getattr(manager, "processes", [])]
        logger.info("vllm: engine up on %s (%s, %s)", self.model_path, kwargs["dtype"],
                    f"engine core process(es) {self.engine_pids}" if self.engine_pids else "in-process")
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

    def generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        from vllm import SamplingParams as VLLMSampling
        from vllm.inputs import TokensPrompt

        self.check_requests(requests, sampling)
        draws = 1 if sampling.greedy else sampling.n  # greedy samples are identical: compute one, repeat it
        prompts, params = [], []
        for position, request in enumerate(requests):
            prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
            data: dict = {}
            if request.images:
                data["image"] = list(request.images)
            if request.videos:
                data["video"] = [(v.frames, v.metadata()) for v in request.videos]
            if data:
                prompt["multi_modal_data"] = data
            prompts.append(prompt)
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
                                    self.options.timeout_s)
        results = [result for request, output in zip(requests, outputs)
                   for result in self._results(request, output, sampling)]
        assert_nothing_banned(results, requests, sampling.n, self.name)
        return results

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
            results.append(RolloutResult(
                uid=request.uid, sample_index=i, response_ids=ids,
                response_logprobs=[pos[t].logprob for pos, t in zip(positions, ids)],
                finish_reason=c.finish_reason if c.finish_reason in ("stop", "length") else "abort",
                top_logprobs=tops))
        return results

    # ------------------------------------------------------------------------------------------------ weights

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None = None
                       ) -> None:
        from safetensors.torch import save

        sync = self.sync_plan(named_tensors, names)
        missing, unknown = sorted(self._checkpoint_names - sync.names), sorted(sync.names - self._checkpoint_names)
        if missing or unknown:
            # vLLM's reload path re-processes whole layers: one given partly is left broken, and so is the model.
            raise ValueError(f"vllm: update_weights needs exactly the model's {len(self._checkpoint_names)} weights: "
                             f"{len(missing)} missing (e.g. {missing[:3]}), {len(unknown)} unknown "
                             f"(e.g. {unknown[:3]})")
        timeout = self.options.timeout_s
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

        def finish() -> None:
            self.llm.collective_rpc("vlmrl_finish_reload")
            # Images already seen would otherwise reuse vision embeddings (and prompts their KV) of the old weights.
            self.llm.llm_engine.reset_encoder_cache()
            if not self.llm.reset_prefix_cache():
                raise RuntimeError("reset_prefix_cache() refused (requests still running?)")

        self._runner.call("finish the weight update", finish, timeout)
        logger.debug("vllm: loaded %d tensors; encoder and prefix caches reset", count)  # every sync: DEBUG

    def serves_adapters(self) -> bool:
        return self.options.max_lora_rank > 0

    def update_adapter(self, folder: str) -> None:
        """Serve this PEFT adapter folder from now on: loaded under a new id (vLLM caches adapters by id), the
        previous one removed, then the encoder cache (vision embeddings of a tower adapter) and the prefix cache
        (KV under the old adapter) reset."""
        from vllm.lora.request import LoRARequest

        if not self.serves_adapters():
            return super().update_adapter(folder)
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

        self._runner.call("load a LoRA adapter", run, self.options.timeout_s)
        self._lora_request = new
        logger.debug("vllm: serving LoRA adapter %s (id %d); encoder and prefix caches reset", folder,
                     new.lora_int_id)

    def _load_bucket(self, blob: bytes) -> int:
        return self._runner.call("load a weight bucket",
                                 lambda: self.llm.collective_rpc("vlmrl_load_bucket", args=(blob,)),
                                 self.options.timeout_s)[0]

    def sleep(self) -> None:
        if not self.options.enable_sleep_mode:
            return super().sleep()
        self._runner.call("sleep", lambda: self.llm.sleep(level=1), self.options.timeout_s)
        self._sleeping = True

    def wake_up(self) -> None:
        if not self._sleeping:
            return super().wake_up()
        self._runner.call("wake up", self.llm.wake_up, self.options.timeout_s)
        self._sleeping = False

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None and not self._runner.broken:
            try:
                self._runner.call("shut down", llm.llm_engine.engine_core.shutdown, 60.0)
            except Exception as err:  # noqa: BLE001 - closing must not raise over a dying engine
                logger.warning("vllm: shutdown: %s", err)
        for pid in self.engine_pids:  # only these processes (and their children), if still there
            kill_tree(pid, grace_s=0)
        self._runner.stop()

