"""Run configuration: typed nested dataclasses, yaml + dotted CLI overrides, checked at load.

Keys follow verl/EasyR1 where users already know them (`data.train_batch_size`, `rollout.n`, `actor.kl_loss_coef`,
`trainer.val_only`...). Every field has a default and a docstring under it; `docs/config.md` is generated from these
docstrings (`python -m vlmrl.config --markdown`), so the documentation cannot drift from the code.

    config = load_config(["config=examples/configs/tiny_synthetic.yaml", "actor.optim.lr=1e-4"])

Invalid combinations raise `ConfigError` at load, listing every problem with what to change.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import inspect
import json
import logging
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from vlmrl.agent.config import AgentConfig

logger = logging.getLogger(__name__)

ROLLOUT_BACKENDS = ("hf", "vllm", "sglang", "sglang-server")
LOGGERS = ("console", "tensorboard", "wandb")
KL_LOSS_TYPES = ("low_var_kl", "k1", "k2", "mse")  # vlmrl.algorithms.grpo.KL_TYPES (not imported: no torch math here)
BAD_IMAGE_POLICIES = ("error", "filter")  # vlmrl.processors.config.BAD_IMAGE_POLICIES
IMAGE_PATCH_PIXELS = 28 * 28  # pixels per image token of Qwen2/2.5-VL (14x14 patches, 2x2 merged)
LR_SCHEDULERS = ("constant", "cosine")
# The algorithm names, as vlmrl.algorithms defines them (not imported: no torch math here; a test keeps them equal)
ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")  # algorithms.advantages
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # .aggregation
POLICY_LOSSES = ("ppo-clip", "gspo", "cispo")  # algorithms.policy_loss
ROLLOUT_CORRECTIONS = ("off", "token_tis", "seq_mis")  # algorithms.correction
SEQ_RATIOS = ("product", "geometric")  # algorithms.correction


class ConfigError(ValueError):
    """A configuration that cannot run; the message lists each problem and what to change."""


@dataclass
class DataConfig:
    train_files: str = ""
    """Training data: parquet file(s) in the verl/EasyR1 schema (comma-separated, globs allowed), or `synthetic` for
    the embedded visual task."""
    val_files: str = ""
    """Validation data, same forms as train_files (`synthetic`: the task's held-out split). Empty: no validation."""
    prompt_key: str = "prompt"
    """Column holding the chat messages."""
    image_key: str = "images"
    """Column holding the images ({bytes} / {path} / PIL)."""
    train_batch_size: int = 512
    """Prompts per training step (each is sampled rollout.n times)."""
    val_batch_size: int = -1
    """Prompts per validation generate call; -1 = the whole validation set in one call."""
    max_prompt_length: int = 1024
    """Longest prompt in tokens, images expanded. Longer prompts are filtered (counted), never truncated."""
    max_response_length: int = 2048
    """Most tokens generated per sample."""
    min_pixels: int = 3136
    """Images smaller than this many pixels are upscaled (qwen-vl-utils rules, factor 28)."""
    max_pixels: int = 1003520
    """Images larger than this many pixels are downscaled (1003520 = 1280 * 28 * 28)."""
    shuffle: bool = True
    """Shuffle training rows every epoch (seeded by trainer.seed)."""
    filter_overlong_prompts: bool = True
    """Drop (and count) prompts over max_prompt_length; False makes them an error naming the row."""
    synthetic_train_size: int = 2048
    """Rows in the synthetic task's train split (only for `synthetic`)."""
    synthetic_val_size: int = 128
    """Rows in the synthetic task's held-out split (only for `synthetic`)."""
    on_bad_image: str = "error"
    """A corrupt, missing, empty, oversized or disallowed image, or a row whose image count differs from its
    placeholders: "error" stops with the row named, "filter" skips the row (counted and logged)."""
    data_root: str | None = None
    """Folder image paths live in: relative paths resolve under it and no path may point outside it (symlinks and
    '..' resolved first). null = paths are taken as given (relative to the working directory)."""
    allow_remote_images: bool = False
    """Fetch http(s) image URLs found in the data. Off: a dataset cannot make the trainer reach the network."""
    remote_timeout_s: float = 10.0
    """Timeout of one remote image fetch (connect and each read), when allow_remote_images."""
    remote_max_bytes: int = 33554432
    """Largest remote image accepted, in bytes (32 MiB); the download stops past it."""
    max_image_pixels: int = 89478485
    """Decompression-bomb guard: an image whose header declares more pixels than this is rejected before it is
    decoded (PIL's default). Not a resize bound: see max_pixels."""


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """AdamW learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    weight_decay: float = 1e-2
    """AdamW weight decay."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps from 0 to lr."""
    lr_scheduler: str = "constant"
    """After warm-up: `constant` or `cosine` (decays to 0 at the last step)."""


@dataclass
class ActorConfig:
    model_path: str = ""
    """Policy to train: a local HF folder, a hub id, or an embedded name (`tiny`, `tiny-large`)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer settings."""
    ppo_mini_batch_size: int = 128
    """Prompts per optimizer step (times rollout.n samples); train_batch_size / this = updates per step."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Samples per forward/backward; micro-batches accumulate gradients. Changes memory, not the update."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    policy_loss: str = "ppo-clip"
    """Policy loss: ppo-clip (token ratio, dual-clip), gspo (sequence-level ratio, GSPO; set clip_ratio_low/high to
    its ~3e-4/4e-4) or cispo (clipped, detached IS weight times logprob: every token keeps a gradient)."""
    loss_agg_mode: str = "token-mean"
    """How token losses become the loss (verl's name): token-mean, seq-mean-token-sum, seq-mean-token-mean,
    seq-mean-token-sum-norm (Dr. GRPO: token sums / (sequences x data.max_response_length)). KL and entropy terms
    aggregate the same way."""
    clip_ratio: float = 0.2
    """PPO clip range: the ratio is clipped to [1 - clip_ratio, 1 + clip_ratio]."""
    clip_ratio_low: float | None = None
    """Lower clip range if different; None = clip_ratio."""
    clip_ratio_high: float | None = None
    """Upper clip range if different (DAPO clip-higher); None = clip_ratio."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip: a negative-advantage token's loss is capped at clip_ratio_c x |A| (> 1; verl's default 3); null
    turns it off. Applies to ppo-clip and gspo."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus (loss -= entropy_coeff * token-mean entropy)."""
    use_kl_loss: bool = False
    """Add a KL loss to a frozen reference (the initial weights). Loads a second copy of the model."""
    kl_loss_coef: float = 0.0
    """Weight of the KL loss; must be > 0 exactly when use_kl_loss is true."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator: low_var_kl (k3), k1, k2 / mse."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; <= 0 disables clipping."""
    freeze_vision_tower: bool = False
    """Keep the vision tower's weights fixed."""
    dtype: str = "float32"
    """Master weights and optimizer state: float32 (an lr-1e-6 update vanishes in bfloat16 weights) or bfloat16."""
    compute_dtype: str = "auto"
    """Forward/backward precision: auto (bfloat16 autocast on GPU, float32 on CPU), float32 or bfloat16."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward (less memory, ~30% slower)."""
    device: str = "auto"
    """Torch device for the actor: auto (cuda when available, else cpu), cpu, cuda, cuda:N."""


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
    """Engine dtype: auto (bfloat16 on GPU, float32 on CPU), float32 or bfloat16."""
    gpu_memory_utilization: float = 0.6
    """Fraction of GPU memory the engine may take (vllm / sglang)."""
    tensor_parallel_size: int = 1
    """Tensor parallel degree of the engine."""
    timeout_s: float = 600.0
    """Every engine call must finish within this, else the run stops with an error naming the backend. One call
    generates the whole step's batch: raise it for large batches x n on one engine."""
    start_timeout_s: float = 600.0
    """The engine's start-up (loading, compiling, CUDA graphs) must finish within this; raise it for large models."""
    limit_images: int = 8
    """Most images one engine request may carry (vLLM limit_mm_per_prompt): prompt images plus, with agent.enable,
    the images tools add to the conversation."""
    server_url: str = ""
    """sglang-server only: URL of a running server; empty = vlmrl launches one on 127.0.0.1."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to the backend as they are (engine-specific)."""


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator: grpo, rloo, reinforce_plus_plus or reinforce_plus_plus_baseline."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide group-centred rewards by the group std (GRPO); false = mean-centred only (Dr. GRPO). grpo only."""
    rollout_correction: str = "off"
    """Correct for the gap between the engine's and the trainer's logprobs: off, token_tis (truncated token-level
    importance weights) or seq_mis (sequences whose ratio leaves a band are taken out of the loss). Turn it on when
    rollout/logprob_abs_diff is not small (bf16 or quantised engine, long responses). Needs rollout.temperature=1."""
    rollout_correction_token_cap: float = 2.0
    """token_tis: the largest importance weight (verl's 2.0)."""
    rollout_correction_seq_low: float = 0.5
    """seq_mis: lower bound of the sequence ratio band (<= 1)."""
    rollout_correction_seq_high: float = 2.0
    """seq_mis: upper bound of the sequence ratio band (>= 1)."""
    rollout_correction_seq_ratio: str = "product"
    """seq_mis: the sequence ratio is the product of token ratios (product) or their geometric mean (geometric,
    length-normalised: use a band like [0.999, 1.001])."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards are all equal (no signal) and draw more prompts until the
    batch holds data.train_batch_size groups with signal. Plain rollout only (not with agent.enable)."""
    dynamic_sampling_max_extra_draws: int = 9
    """Most extra prompt batches drawn per step (verl's max_num_gen_batches=10 counts the first draw too); then
    the step trains on the groups it has (logged in batch/dynamic_sampling_draws and batch/groups_dropped)."""
    overlong_buffer_len: int = 0
    """DAPO's overlong reward shaping: over the last this many tokens before data.max_response_length the reward
    falls linearly, by up to overlong_penalty_factor at the budget. 0 = off."""
    overlong_penalty_factor: float = 1.0
    """The overlong penalty at data.max_response_length (DAPO: 1.0)."""
    mask_truncated: bool = False
    """Take responses cut at data.max_response_length (finish_reason length) out of the loss (DAPO's overlong
    filtering)."""

    def __post_init__(self) -> None:
        # yaml reads `off` (and false / no) as the boolean False, which reaches a str field as "False"
        if self.rollout_correction in ("False", "false"):
            self.rollout_correction = "off"


@dataclass
class RewardConfig:
    function: str = ""
    """Reward: empty = chosen per row by data_source (geo3k, synthetic), a built-in name, or `path/to/file.py:fn`."""
    timeout_s: float | None = 10.0
    """Most seconds the reward function may take on one sample. A sample that takes longer is stopped (its worker
    process is killed and replaced), scores 0 and is flagged reward_failed=1 and reward_timeout=1 (metrics
    reward/timeouts, val/reward_timeouts); the run goes on. With a limit the function runs in reward.num_workers worker
    processes, so it must be defined at module level (built-ins, `path/to/file.py:fn` and `package.module:fn` are),
    and module-level state in it is per worker. 0 or null: no limit, scored in the trainer's process."""
    num_workers: int = 1
    """Worker processes scoring under reward.timeout_s; each gets one contiguous share of every batch. More
    score a batch in parallel (slow graders such as sympy-based ones)."""


@dataclass
class TrainerConfig:
    total_epochs: int = 1
    """Passes over the training data (ignored when total_steps is set)."""
    total_steps: int | None = None
    """Training steps to run; None = total_epochs worth."""
    val_before_train: bool = True
    """Validate the initial weights (step 0)."""
    test_freq: int = 5
    """Validate every this many steps (and after the last); <= 0 = only val_before_train."""
    val_only: bool = False
    """Validate-only mode: no optimizer, weights untouched; writes metrics and the per-sample artifact."""
    save_freq: int = -1
    """Save a checkpoint every this many steps (and after the last); <= 0 = never."""
    max_ckpt_to_keep: int | None = 2
    """Keep the newest K checkpoints; None = keep all."""
    resume: bool = True
    """Resume from the newest complete checkpoint in output_dir when there is one."""
    output_dir: str = "outputs/run"
    """Where metrics.jsonl, checkpoints, artifacts and plots go."""
    seed: int = 1
    """Seeds data order, sampling and torch."""
    logger: list[str] = field(default_factory=lambda: ["console"])
    """Metric sinks besides metrics.jsonl (always written): console, tensorboard, wandb."""
    project_name: str = "vlmrl"
    """W&B project."""
    experiment_name: str = "grpo"
    """W&B run name."""
    format_warmup_steps: int = 0
    """Supervised steps on RANDOM answer labels before RL, teaching only the answer format (never the answers):
    a random-init model otherwise never produces a gradable answer. Needs a task with a closed answer set."""
    format_warmup_lr: float = 1e-3
    """Learning rate of the format warm-up (its own AdamW, discarded afterwards)."""
    format_warmup_batch_size: int = 32
    """Prompts per format warm-up step."""
    torch_threads: int = 0
    """torch.set_num_threads; 0 leaves torch's default (1 is often fastest on small CPUs)."""
    n_gpus_per_node: int = 1
    """Training devices per node; more than one device in all runs Ray workers with FSDP2 (vlmrl.distributed)."""
    nnodes: int = 1
    """Nodes in the Ray cluster."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and lengths."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy being trained and its update."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation backend and sampling."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimation, rollout correction and DAPO's data-side options."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop, validation, checkpoints, logging."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn rollout with tools and partial rollout (vlmrl.agent; docs/agent.md)."""


def load_config(args: list[str] | None = None, check_model: bool = True) -> Config:
    """Build a Config from `config=FILE.yaml` (optional, repeatable) and dotted `key=value` overrides, in order.

    Raises ConfigError for unknown keys (with the closest valid one), bad values and invalid combinations.
    `check_model` also reads the model's config.json (local folders and embedded names) to check lengths fit.
    """
    merged = OmegaConf.structured(Config)
    for arg in args or []:
        if "=" not in arg:
            raise ConfigError(f"argument {arg!r} is not key=value (use config=FILE.yaml or e.g. rollout.n=8)")
        key, value = arg.split("=", 1)
        try:
            if key == "config":
                overlay = OmegaConf.load(value)
            else:  # `key=` means the empty string (OmegaConf would read it as null)
                overlay = OmegaConf.from_dotlist([arg if value else f"{key}=''"])
            merged = OmegaConf.merge(merged, overlay)
        except FileNotFoundError:
            raise ConfigError(f"config file {value!r} does not exist") from None
        except ConfigKeyError as err:
            raise ConfigError(_unknown_key_message(err)) from None
        except OmegaConfBaseException as err:
            raise ConfigError(f"bad value in {arg!r}: {str(err).splitlines()[0]}") from None
    config: Config = OmegaConf.to_object(merged)
    problems = validate(config)
    if check_model and not problems:
        problems = check_model_context(config)
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))
    return config


def _unknown_key_message(err: ConfigKeyError) -> str:
    full_key = getattr(err, "full_key", None) or str(err)
    known = [key for key, _, _ in describe(Config)]
    close = difflib.get_close_matches(str(full_key), known, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else "; see docs/config.md for every key"
    return f"unknown config key {full_key!r}{hint}"


def validate(config: Config) -> list[str]:
    """Every problem with a config, each saying what to change. Empty when it can run."""
    d, a, r, t = config.data, config.actor, config.rollout, config.trainer
    problems: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    need(bool(a.model_path), "actor.model_path is empty: set a HF model folder, a hub id, or `tiny`")
    if t.val_only:
        need(bool(d.val_files), "trainer.val_only=true needs data.val_files")
    else:
        need(bool(d.train_files), "data.train_files is empty: set parquet file(s) or `synthetic`")
        need(not t.val_before_train or bool(d.val_files),
             "trainer.val_before_train=true needs data.val_files (or set trainer.val_before_train=false)")
    need(r.name in ROLLOUT_BACKENDS, f"rollout.name={r.name!r} is not one of {list(ROLLOUT_BACKENDS)}")
    engine = {"vllm": "vllm", "sglang": "sglang", "sglang-server": "sglang"}.get(r.name)
    if engine and not (r.name == "sglang-server" and r.server_url):  # found now, not after the model has loaded
        need(importlib.util.find_spec(engine) is not None,
             f"rollout.name={r.name} needs {engine}, which is not installed in this environment: `make setup` "
             f"(CPU) or `pip install -e '.[{engine}]'` (GPU), or pick another rollout.name")
    need(r.n >= 2, f"rollout.n={r.n}: GRPO compares samples within a group, so it needs rollout.n >= 2")
    need(r.temperature > 0, f"rollout.temperature={r.temperature}: training rollouts must sample (set > 0, e.g. 1.0)")
    need(r.val_n >= 1, f"rollout.val_n={r.val_n} must be >= 1")
    need(r.val_top_logprobs == 0 or r.val_top_logprobs >= 2,
         f"rollout.val_top_logprobs={r.val_top_logprobs} must be 0 (none) or >= 2: the compare tool looks for each "
         "side's token among the other side's top-k, which a top-1 list can never hold")
    need(r.val_n == 1 or r.val_temperature > 0,
         f"rollout.val_n={r.val_n} with val_temperature=0 gives {r.val_n} identical greedy samples: "
         "set rollout.val_temperature > 0 or rollout.val_n=1")
    for key, value in (("data.train_batch_size", d.train_batch_size),
                       ("actor.ppo_mini_batch_size", a.ppo_mini_batch_size),
                       ("actor.ppo_micro_batch_size_per_gpu", a.ppo_micro_batch_size_per_gpu),
                       ("actor.ppo_epochs", a.ppo_epochs), ("data.max_prompt_length", d.max_prompt_length),
                       ("data.max_response_length", d.max_response_length)):
        need(value >= 1, f"{key}={value} must be >= 1")
    if not problems:
        need(d.train_batch_size % a.ppo_mini_batch_size == 0,
             f"data.train_batch_size * rollout.n = {d.train_batch_size * r.n} samples do not split into "
             f"mini-batches of actor.ppo_mini_batch_size * rollout.n = {a.ppo_mini_batch_size * r.n}: make "
             "data.train_batch_size a multiple of actor.ppo_mini_batch_size (e.g. ppo_mini_batch_size="
             f"{_largest_divisor(d.train_batch_size, a.ppo_mini_batch_size)})")
        need((a.ppo_mini_batch_size * r.n) % a.ppo_micro_batch_size_per_gpu == 0,
             f"a mini-batch of {a.ppo_mini_batch_size * r.n} samples (ppo_mini_batch_size * rollout.n) does not "
             f"split into micro-batches of actor.ppo_micro_batch_size_per_gpu={a.ppo_micro_batch_size_per_gpu}: "
             f"pick a divisor of {a.ppo_mini_batch_size * r.n}")
    need(not (a.use_kl_loss and a.kl_loss_coef <= 0),
         "actor.use_kl_loss=true with kl_loss_coef=0 loads a reference model for nothing: set actor.kl_loss_coef > 0 "
         "(e.g. 0.01) or actor.use_kl_loss=false")
    need(not (a.kl_loss_coef > 0 and not a.use_kl_loss),
         f"actor.kl_loss_coef={a.kl_loss_coef} needs a reference model: set actor.use_kl_loss=true, or kl_loss_coef=0")
    need(a.kl_loss_type in KL_LOSS_TYPES, f"actor.kl_loss_type={a.kl_loss_type!r} is not one of {list(KL_LOSS_TYPES)}")
    need(0 < a.clip_ratio < 1, f"actor.clip_ratio={a.clip_ratio} must be in (0, 1) (0.2 is standard)")
    need(a.clip_ratio_high is None or a.clip_ratio_high > 0, "actor.clip_ratio_high must be > 0 (or null)")
    # ---- actor: policy loss and loss aggregation
    need(a.policy_loss in POLICY_LOSSES, f"actor.policy_loss={a.policy_loss!r} is not one of {list(POLICY_LOSSES)}")
    need(a.loss_agg_mode in LOSS_AGG_MODES,
         f"actor.loss_agg_mode={a.loss_agg_mode!r} is not one of {list(LOSS_AGG_MODES)}")
    need(a.clip_ratio_low is None or a.clip_ratio_low > 0, "actor.clip_ratio_low must be > 0 (or null)")
    need(a.clip_ratio_c is None or a.clip_ratio_c > 1,
         f"actor.clip_ratio_c={a.clip_ratio_c} must be > 1 (3 is verl's default) or null (no dual-clip)")
    need(a.policy_loss != "gspo" or (a.clip_ratio_low is not None and a.clip_ratio_high is not None),
         "actor.policy_loss=gspo clips a sequence-level ratio, which moves far less than a token's: set "
         "actor.clip_ratio_low and actor.clip_ratio_high explicitly (the GSPO paper: 3e-4 and 4e-4)")
    problems += algorithm_problems(config)
    need(a.optim.lr > 0, f"actor.optim.lr={a.optim.lr} must be > 0")
    need(len(a.optim.betas) == 2, f"actor.optim.betas={a.optim.betas} must be two numbers, e.g. [0.9, 0.999]")
    need(a.optim.lr_scheduler in LR_SCHEDULERS,
         f"actor.optim.lr_scheduler={a.optim.lr_scheduler!r} is not one of {list(LR_SCHEDULERS)}")
    need(a.dtype in ("float32", "bfloat16"), f"actor.dtype={a.dtype!r} must be float32 or bfloat16")
    for key, value in (("actor.compute_dtype", a.compute_dtype), ("rollout.dtype", r.dtype)):
        need(value in ("auto", "float32", "bfloat16"), f"{key}={value!r} must be auto, float32 or bfloat16")
    need(d.min_pixels <= d.max_pixels, f"data.min_pixels={d.min_pixels} > data.max_pixels={d.max_pixels}")
    need(d.min_pixels >= IMAGE_PATCH_PIXELS,
         f"data.min_pixels={d.min_pixels} is below one 28x28 patch ({IMAGE_PATCH_PIXELS})")
    need(t.total_steps is None or t.total_steps >= 1, f"trainer.total_steps={t.total_steps} must be >= 1 (or null)")
    need(t.total_epochs >= 1, f"trainer.total_epochs={t.total_epochs} must be >= 1")
    need(t.max_ckpt_to_keep is None or t.max_ckpt_to_keep >= 1,
         f"trainer.max_ckpt_to_keep={t.max_ckpt_to_keep} must be >= 1 (or null to keep all)")
    unknown_loggers = [name for name in t.logger if name not in LOGGERS]
    need(not unknown_loggers, f"trainer.logger has unknown sink(s) {unknown_loggers}; choose from {list(LOGGERS)}")
    need(t.test_freq <= 0 or t.val_only or bool(d.val_files),
         f"trainer.test_freq={t.test_freq} needs data.val_files (or set trainer.test_freq=-1)")
    need(t.format_warmup_steps >= 0, f"trainer.format_warmup_steps={t.format_warmup_steps} must be >= 0")
    for key, value in (("rollout.timeout_s", r.timeout_s), ("rollout.start_timeout_s", r.start_timeout_s)):
        need(value > 0, f"{key}={value} must be > 0 (seconds): every engine call has a deadline")
    need(config.reward.timeout_s is None or config.reward.timeout_s >= 0,
         f"reward.timeout_s={config.reward.timeout_s} must be >= 0 (0 or null = no limit, scored in this process)")
    need(config.reward.num_workers >= 1, f"reward.num_workers={config.reward.num_workers} must be >= 1")
    world = t.n_gpus_per_node * t.nnodes
    need(t.n_gpus_per_node >= 1 and t.nnodes >= 1, "trainer.n_gpus_per_node and trainer.nnodes must be >= 1")
    if world > 1:
        need((a.ppo_mini_batch_size * r.n) % world == 0,
             f"a mini-batch of {a.ppo_mini_batch_size * r.n} samples (ppo_mini_batch_size * rollout.n) does not split "
             f"over {world} devices (n_gpus_per_node * nnodes): make it a multiple of {world}")
        need(t.format_warmup_steps == 0, "trainer.format_warmup_steps is single-device only (it is for the embedded "
             "tiny model): set it to 0 or run on one device")
        need(r.name != "sglang-server", "rollout.name=sglang-server cannot be colocated with multi-device training: "
             "use sglang (one engine per worker) or vllm")
        need(r.tensor_parallel_size == 1, f"rollout.tensor_parallel_size={r.tensor_parallel_size}: with "
             f"{world} devices each colocated engine runs on its worker's one device; set it to 1")
    problems += data_image_problems(d)
    if config.agent.enable:
        problems += agent_problems(config)
    return problems


def algorithm_problems(config: Config) -> list[str]:
    """The algorithm section's checks (estimator, rollout correction, DAPO) and how they fit the other sections."""
    al, d = config.algorithm, config.data
    out = []
    if al.adv_estimator not in ADV_ESTIMATORS:
        out.append(f"algorithm.adv_estimator={al.adv_estimator!r} is not one of {list(ADV_ESTIMATORS)}")
    elif al.adv_estimator != "grpo" and not al.norm_adv_by_std_in_grpo:
        out.append(f"algorithm.norm_adv_by_std_in_grpo=false (Dr. GRPO) applies to adv_estimator=grpo only, not "
                   f"{al.adv_estimator}: set it to true or use adv_estimator=grpo")
    if al.rollout_correction not in ROLLOUT_CORRECTIONS:
        out.append(f"algorithm.rollout_correction={al.rollout_correction!r} is not one of {list(ROLLOUT_CORRECTIONS)}")
    elif al.rollout_correction != "off" and config.rollout.temperature != 1.0:
        out.append(f"algorithm.rollout_correction={al.rollout_correction} compares the engine's logprobs with the "
                   f"trainer's, which are of the same distribution only at rollout.temperature=1 (it is "
                   f"{config.rollout.temperature}): set rollout.temperature=1.0 or rollout_correction=off")
    if al.rollout_correction_seq_ratio not in SEQ_RATIOS:
        out.append(f"algorithm.rollout_correction_seq_ratio={al.rollout_correction_seq_ratio!r} is not one of "
                   f"{list(SEQ_RATIOS)}")
    if not al.rollout_correction_token_cap > 0:
        out.append(f"algorithm.rollout_correction_token_cap={al.rollout_correction_token_cap} must be > 0 (2.0)")
    if not 0 < al.rollout_correction_seq_low <= 1.0 <= al.rollout_correction_seq_high:
        out.append(f"algorithm.rollout_correction_seq_low/high = {al.rollout_correction_seq_low}/"
                   f"{al.rollout_correction_seq_high} must satisfy 0 < low <= 1 <= high (e.g. 0.5 and 2.0)")
    if al.dynamic_sampling and config.agent.enable:
        out.append("algorithm.dynamic_sampling needs the plain rollout: the agent loop takes its prompts from a queue "
                   "and carries partial groups between steps. Set algorithm.dynamic_sampling=false or agent.enable="
                   "false")
    if al.dynamic_sampling_max_extra_draws < 0:
        out.append(f"algorithm.dynamic_sampling_max_extra_draws={al.dynamic_sampling_max_extra_draws} must be >= 0")
    if not 0 <= al.overlong_buffer_len <= d.max_response_length:
        out.append(f"algorithm.overlong_buffer_len={al.overlong_buffer_len} must be in [0, data.max_response_length="
                   f"{d.max_response_length}] (0 = off; DAPO: 4096 of 20480)")
    if al.overlong_penalty_factor < 0:
        out.append(f"algorithm.overlong_penalty_factor={al.overlong_penalty_factor} must be >= 0 (DAPO: 1.0)")
    return out


def data_image_problems(d: DataConfig) -> list[str]:
    """The processor's image-safety keys (vlmrl.processors.ProcessorConfig checks them again when it is built)."""
    out = []
    if d.on_bad_image not in BAD_IMAGE_POLICIES:
        out.append(f"data.on_bad_image={d.on_bad_image!r} is not one of {list(BAD_IMAGE_POLICIES)}")
    for key, value in (("data.remote_timeout_s", d.remote_timeout_s), ("data.remote_max_bytes", d.remote_max_bytes),
                       ("data.max_image_pixels", d.max_image_pixels)):
        if value <= 0:
            out.append(f"{key}={value} must be > 0")
    if d.max_image_pixels < d.max_pixels:
        out.append(f"data.max_image_pixels={d.max_image_pixels} rejects images data.max_pixels={d.max_pixels} allows "
                   "after resizing: raise data.max_image_pixels")
    return out


def agent_problems(config: Config) -> list[str]:
    """The agent section's own checks, and how it must fit the data and rollout sections."""
    ag, d, r = config.agent, config.data, config.rollout
    out = list(config.agent.problems())
    if ag.max_response_tokens > d.max_response_length:
        out.append(f"agent.max_response_tokens={ag.max_response_tokens} > data.max_response_length="
                   f"{d.max_response_length}: a trajectory must fit the padded response; lower "
                   "agent.max_response_tokens or raise data.max_response_length")
    if ag.tools and ag.max_tool_images > 0:
        if 1 + ag.max_tool_images > r.limit_images:
            out.append(f"agent.max_tool_images={ag.max_tool_images} plus the prompt's image exceeds "
                       f"rollout.limit_images={r.limit_images}: the engine would reject the conversation; raise "
                       "rollout.limit_images or lower agent.max_tool_images")
        image_tokens = d.max_pixels // IMAGE_PATCH_PIXELS
        budget = min(ag.max_response_tokens, d.max_response_length)
        if image_tokens >= budget:
            out.append(f"one tool image at data.max_pixels={d.max_pixels} takes up to {image_tokens} response tokens, "
                       f"the whole response budget of {budget}: lower data.max_pixels, raise agent.max_response_tokens "
                       "and data.max_response_length, or set agent.max_tool_images=0")
    return out


def _largest_divisor(total: int, at_most: int) -> int:
    return max(k for k in range(1, min(total, at_most) + 1) if total % k == 0)


def check_model_context(config: Config) -> list[str]:
    """Check prompt + response lengths fit the model's context, for local folders and embedded models.
    Hub ids that are not downloaded are skipped (the engine checks again when it loads them)."""
    from vlmrl.models import is_embedded, is_hub_id, resolve_model_path

    path = config.actor.model_path
    if not (is_embedded(path) or Path(path).expanduser().is_dir()):
        if not is_hub_id(path):
            return [f"actor.model_path={path!r}: no such folder (nor an embedded name like `tiny`, or a hub id like "
                    "Qwen/Qwen2.5-VL-7B-Instruct)"]
        logger.info("model %s is not a local folder: its context length is checked when it loads", path)
        return []
    config_file = Path(resolve_model_path(path)).expanduser() / "config.json"
    if not config_file.exists():
        return [f"actor.model_path={path!r} has no config.json: is it a HF model folder?"]
    model_config = json.loads(config_file.read_text())
    context = model_config.get("text_config", {}).get("max_position_embeddings") or model_config.get(
        "max_position_embeddings")
    total = config.data.max_prompt_length + config.data.max_response_length
    if context and total > context:
        return [f"data.max_prompt_length + data.max_response_length = {total} exceeds the model's context of {context} "
                f"tokens ({path}): lower one of them"]
    return []


def to_dict(config: Config) -> dict[str, Any]:
    """Plain nested dict (for artifacts, checkpoints and W&B)."""
    return dataclasses.asdict(config)


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


# ---- documentation generated from the dataclasses ------------------------------------------------------------------


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each field of a dataclass (read from its source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(following, ast.Expr) and isinstance(getattr(following, "value", None), ast.Constant):
                docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default as yaml text, docstring) for every leaf field, in declaration order."""
    rows = []
    docs = field_docs(cls)
    instance = cls()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            rows.extend(describe(type(value), prefix=f"{key}."))
        else:
            rows.append((key, json.dumps(value), docs.get(f.name, "")))
    return rows


def markdown() -> str:
    """docs/config.md: every key, its default and meaning."""
    lines = [
        "# Configuration keys",
        "",
        "Generated from `vlmrl/config.py` by `python -m vlmrl.config --markdown > docs/config.md`; a test checks it is",
        "current. Set keys in a yaml file (`config=FILE.yaml`, nested by section) or on the command line as dotted",
        "overrides (`rollout.n=8`). Invalid combinations are rejected at load with what to change.",
        "",
    ]
    docs = field_docs(Config)
    for section in dataclasses.fields(Config):
        lines += [f"## `{section.name}` — {docs.get(section.name, '')}", "", "| key | default | meaning |",
                  "|---|---|---|"]
        for key, default, doc in describe(type(getattr(Config(), section.name)), prefix=f"{section.name}."):
            escaped = doc.replace("|", "\\|")
            lines.append(f"| `{key}` | `{default}` | {escaped} |")
        lines.append("")
    return "\n".join(lines)


def readme_reference() -> str:
    """The README's configuration reference: the same tables one heading level down, without the title."""
    body = markdown().split("\n", 2)[2]
    return "\n".join("#" + line if line.startswith("## ") else line for line in body.splitlines()) + "\n"


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--markdown"]:
        print(markdown(), end="")
    elif sys.argv[1:2] in (["-h"], ["--help"]):
        print("python -m vlmrl.config [config=FILE.yaml] [key=value ...]   print the resolved config as YAML\n"
              "python -m vlmrl.config --markdown                        the reference of every key (docs/config.md)")
    else:
        try:
            print(to_yaml(load_config(sys.argv[1:])), end="")
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
