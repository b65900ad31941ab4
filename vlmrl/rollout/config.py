"""Rollout configuration: the backend, its sampling, and the engine options every backend takes (the run config's
`rollout` section).

Each engine option is declared once, in the class of the backends that take it: `EngineOptions` (every backend),
`ServingEngineOptions` (vllm and sglang) and `ServerOptions` (sglang-server). `RolloutConfig` (the `rollout.*` keys)
inherits all three; each backend's options class inherits those it takes (`vlmrl.rollout.base.RolloutOptions`, the
base of them all, adds what the run derives: max_model_len from the data lengths and seed from trainer.seed). Knobs
only one engine has stay in that backend's options class (`VLLMOptions.enforce_eager`,
`SGLangOptions.attention_backend`...), set through `get_backend(name, path, **options)`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from vlmrl.actor.config import PRECISIONS, LoraConfig

BACKENDS: dict[str, tuple[str, str]] = {
    "hf": ("vlmrl.rollout.hf", "HFBackend"),
    "vllm": ("vlmrl.rollout.vllm", "VLLMBackend"),
    "sglang": ("vlmrl.rollout.sglang", "SGLangBackend"),
    "sglang-server": ("vlmrl.rollout.sglang", "SGLangServerBackend"),
}
"""Backend name -> (module, class); modules import their engine only inside the backend's methods."""
ENGINE_PACKAGES = {"vllm": "vllm", "sglang": "sglang", "sglang-server": "sglang"}
"""The package each engine backend needs installed (hf needs only transformers)."""
ADAPTER_BACKENDS = ("vllm",)
"""Backends that serve a LoRA policy's adapter itself (actor.lora.sync adapter / auto). SGLang's LoRA loading
allocates pinned memory, which needs an accelerator (measured with SGLang 0.5.23 on CPU: it fails at start), so the
sglang backends get merged weights."""


def lora_engine_options(lora: LoraConfig, backend: str) -> dict[str, Any]:
    """Engine options a LoRA policy's sync path needs: vLLM started to serve adapters when actor.lora syncs them
    (sync adapter, or auto), with tower/connector LoRA for lora.vision; nothing otherwise."""
    if not lora.enabled or lora.sync == "merged" or backend not in ADAPTER_BACKENDS:
        return {}
    return {"max_lora_rank": lora.rank, "tower_connector_lora": lora.vision != "off"}


@dataclass
class EngineOptions:
    """Engine options of the run's rollout section that every backend takes."""

    dtype: str = "auto"
    """Engine dtype: auto (bfloat16 on GPU, float32 on CPU), float32 or bfloat16."""
    timeout_s: float = 600.0
    """Every engine call must finish within this, else the run stops with an error naming the backend. One call
    generates the whole step's batch: raise it for large batches x n on one engine."""
    start_timeout_s: float = 600.0
    """The engine's start-up (loading, compiling, CUDA graphs) must finish within this; raise it for large models."""
    sync_bucket_mb: float = 512.0
    """Weight sync moves the weights this many MiB at a time (verl's update_weights_bucket_megabytes): each bucket is
    gathered, cast to the engine's dtype and loaded before the next is read, so a rank's host memory holds about one
    bucket instead of the model (several copies of it before). 0 = the whole model in one bucket."""
    limit_images: int = 8
    """Most images one engine request may carry (vLLM limit_mm_per_prompt): prompt images plus, with agent.enable,
    the images tools add to the conversation."""
    limit_videos: int = 1
    """Most videos one engine request may carry (vLLM limit_mm_per_prompt; vLLM profiles memory for this many videos
    of the largest size at start-up, so keep it at what the data holds)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments given to the engine as they are (vLLM `LLM(...)`, SGLang `Engine(...)` or server
    flags, transformers `from_pretrained(...)` for hf)."""


@dataclass
class ServingEngineOptions:
    """Engine options only the serving engines take (vllm, sglang, sglang-server; not the hf reference)."""

    gpu_memory_utilization: float = 0.6
    """Fraction of GPU memory the engine may take, weights + KV cache (vllm; sglang's mem_fraction_static). Not used
    on CPU."""
    tensor_parallel_size: int = 1
    """Tensor parallel degree of the engine (vllm; sglang's tp_size)."""
    family_engine_settings: bool = True
    """Start the engine with the model family's settings that make it compute what transformers computes, where the
    model's config.json lacks them (README "Supported models": Qwen3-VL's mrope_interleaved), and refuse an
    sglang-server given by URL that runs without them. false: the engine reads config.json as it is (a warning names
    what will then differ): only to reproduce a misconfigured deployment with the alignment tool."""


@dataclass
class ServerOptions:
    """What only the sglang-server backend takes."""

    server_url: str = ""
    """sglang-server only: URL of a running server (e.g. http://10.0.0.5:30000); empty = vlmrl launches one on
    127.0.0.1. A server given by URL must run with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (checked at connect) and see this
    machine's temp folder for weight updates (update_weights_from_disk)."""


@dataclass
class RolloutConfig(EngineOptions, ServingEngineOptions, ServerOptions):
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

    def problems(self) -> list[str]:
        """What is wrong, each with what to change; empty when valid."""
        out = []
        if self.name not in BACKENDS:
            out.append(f"rollout.name={self.name!r} is not one of {list(BACKENDS)}")
        engine = ENGINE_PACKAGES.get(self.name)
        client_only = self.name == "sglang-server" and bool(self.server_url)  # a server given by URL
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
        return out
