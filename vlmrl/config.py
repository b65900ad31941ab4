"""Run configuration: the sections every component declares, composed; yaml + dotted CLI overrides, checked at load.

Keys follow verl/EasyR1 where users already know them (`data.train_batch_size`, `rollout.n`, `actor.kl_loss_coef`,
`trainer.val_only`...). Each component owns its section in its own package (`vlmrl/<package>/config.py`: a dataclass
whose fields have a default and a docstring under them, and a `problems()` check of its own), composed, never
inherited: a section holds its sub-sections as fields (`rollout.vllm`, `actor.lora`...). This module composes the
sections into `Config`, checks the rules that span sections, and computes what the run derives from them, once
(`Config.derived`). `docs/config.md` is generated from the field docstrings (`python scripts/gen_config_docs.py`), so
the documentation cannot drift from the code.

    config = load_config(["config=examples/configs/tiny_synthetic.yaml", "actor.optim.lr=1e-4"])

Invalid combinations raise `ConfigError` at load, listing every problem with what to change.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import logging
import math
import textwrap
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from vlmrl.actor.config import ActorConfig, LoraConfig, OptimConfig
from vlmrl.agent.config import AgentConfig
from vlmrl.algorithms.config import AlgorithmConfig
from vlmrl.data.config import IMAGE_PATCH_PIXELS, DataConfig
from vlmrl.rewards.config import JUDGE_ENGINES, RewardConfig
from vlmrl.rollout.config import ADAPTER_BACKENDS, BACKEND_SECTIONS, BACKENDS, RolloutConfig
from vlmrl.trainer.config import TrainerConfig

logger = logging.getLogger(__name__)

ROLLOUT_BACKENDS = tuple(BACKENDS)

REMOVED_KEYS = {
    "data.on_overlong": "data.filter_overlong_prompts (true = filter, false = error)",
}
"""Keys that are gone: setting the old name fails with a message naming what replaced it."""
RENAMED_KEYS = {
    "rollout.server_url": "rollout.server.url",
    "reward.judge.server.host": "reward.judge.server.http.host",
    "reward.judge.server.port": "reward.judge.server.http.port",
    "reward.judge.server.log_file": "reward.judge.server.http.log_file",
}
"""Keys that moved and still work for one release, with a warning naming the new key (old -> new)."""
ENGINE_KWARGS_KEYS = ("rollout.engine_kwargs", "reward.judge.server.args")
"""Engine arguments of earlier releases, one dict for every engine: each now moves to the engine_kwargs of the
engine the config picks (rollout.<vllm|sglang|hf>.engine_kwargs for rollout.name; reward.judge.server.<sglang|vllm>
.engine_kwargs for reward.judge.server.engine), with a warning, for one release."""


__all__ = [
    "ROLLOUT_BACKENDS", "ActorConfig", "AgentConfig", "AlgorithmConfig", "Config", "ConfigError", "DataConfig",
    "Derived", "LoraConfig", "OptimConfig", "RewardConfig", "RolloutConfig", "TrainerConfig", "check_model_context",
    "describe", "field_docs", "load_config", "to_dict", "to_yaml", "validate",
]


class ConfigError(ValueError):
    """A configuration that cannot run; the message lists each problem and what to change."""


@dataclass(frozen=True)
class Derived:
    """What a run computes from its sections: defined here once and read everywhere, never set by a user."""

    max_model_len: int
    """data.max_prompt_length + data.max_response_length: the longest request (expanded prompt + response) an engine
    must hold, and the trainer's longest row."""
    mini_batch_samples: int
    """actor.ppo_mini_batch_size * rollout.n: the samples of one optimizer step."""
    train_batch_samples: int
    """data.train_batch_size * rollout.n: the samples of one training step."""
    world_size: int
    """trainer.n_gpus_per_node * trainer.nnodes: the data-parallel ranks (one process per device)."""
    batch_multiple: int
    """lcm(world_size, mini_batch_samples): a training batch is padded with padding rows to a multiple of it, so it
    splits into whole mini-batches over the ranks (`vlmrl.batch.padding.required_batch_multiple`)."""
    max_staleness: int
    """trainer.async_rollout.max_staleness when the asynchronous placement is on, else 0: how many updates older
    than the trainer's weights a batch's may be."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and lengths."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy being trained and its update."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation backend, sampling, and each engine's own options."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimation, rollout correction and DAPO's data-side options."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward function."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop, validation, checkpoints, logging."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn rollout with tools and partial rollout (vlmrl.agent; docs/agent.md)."""

    @property
    def derived(self) -> Derived:
        """The values the run derives from its sections (`Derived`)."""
        d, r = self.data, self.rollout
        a, world, mini = self.trainer.async_rollout, self.trainer.world_size, self.actor.ppo_mini_batch_size * r.n
        return Derived(max_model_len=d.max_prompt_length + d.max_response_length, mini_batch_samples=mini,
                       train_batch_samples=d.train_batch_size * r.n, world_size=world,
                       batch_multiple=math.lcm(world, mini), max_staleness=a.max_staleness if a.enable else 0)


_YAML_HINT = (": a command-line value is read as YAML: put text with line breaks in a config file (e.g. `template: |` "
              "and the text indented below it); quote one-line text with `: ` in it inside the argument: "
              "key='\"...\"'")


def load_config(args: list[str] | None = None, check_model: bool = True) -> Config:
    """Build a Config from `config=FILE.yaml` (optional, repeatable) and dotted `key=value` overrides, in order.

    Raises ConfigError for unknown keys (with the closest valid one), bad values and invalid combinations.
    `check_model` also reads the model's config.json (local folders and embedded names) to check lengths fit.
    """
    merged = OmegaConf.structured(Config)
    legacy_engine_kwargs: dict[str, dict[str, Any]] = {}
    for arg in args or []:
        if "=" not in arg:
            raise ConfigError(f"argument {arg!r} is not key=value (use config=FILE.yaml or e.g. rollout.n=8)")
        key, value = arg.split("=", 1)
        try:
            if key == "config":
                overlay = OmegaConf.load(value)
            else:  # `key=` means the empty string (OmegaConf would read it as null)
                overlay = OmegaConf.from_dotlist([arg if value else f"{key}=''"])
            for key, kwargs in _move_renamed_keys(overlay, arg).items():
                legacy_engine_kwargs.setdefault(key, {}).update(kwargs)
            merged = OmegaConf.merge(merged, overlay)
        except FileNotFoundError:
            raise ConfigError(f"config file {value!r} does not exist") from None
        except ConfigKeyError as err:
            raise ConfigError(_unknown_key_message(err)) from None
        except yaml.YAMLError as err:  # a value (or a file) that is not YAML: one line naming the key or file
            where = f"config file {value!r}" if key == "config" else f"the value of {key}"
            raise ConfigError(f"{where} is not valid YAML ({str(err).splitlines()[0]})" +
                              ("" if key == "config" else _YAML_HINT)) from None
        except OmegaConfBaseException as err:
            hint = _YAML_HINT if "Cannot convert 'DictConfig'" in str(err) or "Cannot convert 'ListConfig'" in str(
                err) else ""
            raise ConfigError(f"bad value in {arg[:200]!r}: {str(err).splitlines()[0][:300]}{hint}") from None
    config: Config = OmegaConf.to_object(merged)
    for key, kwargs in legacy_engine_kwargs.items():
        _place_engine_kwargs(config, key, kwargs)
    problems = validate(config)
    if check_model and not problems:
        problems = check_model_context(config)
    if problems:
        raise ConfigError("invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems))
    if check_model and config.algorithm.distill.enabled:  # before any engine: the teacher must read the student's ids
        from vlmrl.processors.teacher import teacher_refusal

        refusal = teacher_refusal(config.actor.model_path, config.algorithm.distill.teacher)
        if refusal:
            raise ConfigError(refusal)
    return config


def _move_renamed_keys(overlay: Any, source: str) -> dict[str, dict[str, Any]]:
    """Move the renamed keys of one overlay (a yaml file or a dotted override) to their new names, warning once for
    each; returns the old engine arguments it holds by key (ENGINE_KWARGS_KEYS), placed once the config's engines
    are known (`_place_engine_kwargs`)."""
    missing = object()
    for old, new in RENAMED_KEYS.items():
        value = OmegaConf.select(overlay, old, default=missing)
        if value is not missing:
            _delete(overlay, old)
            OmegaConf.update(overlay, new, value, force_add=True)
            warnings.warn(f"config key {old!r} (in {source}) is now {new!r}; the old name stops working in the next "
                          "release", FutureWarning, stacklevel=3)
    found = {}
    for old in ENGINE_KWARGS_KEYS:
        value = OmegaConf.select(overlay, old, default=missing)
        if value is not missing:
            _delete(overlay, old)
            found[old] = dict(OmegaConf.to_container(value)) if value is not None else {}
    return found


def _delete(overlay: Any, dotted: str) -> None:
    *parents, leaf = dotted.split(".")
    node = overlay
    for part in parents:
        node = node[part]
    del node[leaf]


def _place_engine_kwargs(config: Config, old: str, kwargs: dict[str, Any]) -> None:
    """Old engine arguments go to the engine_kwargs of the engine the config picks (engine arguments are per engine
    now): rollout.name's for rollout.engine_kwargs, reward.judge.server.engine's for reward.judge.server.args."""
    if old == "rollout.engine_kwargs":
        engine = BACKEND_SECTIONS.get(config.rollout.name, ("vllm",))[0]
        owner, new, chosen = config.rollout, f"rollout.{engine}.engine_kwargs", f"rollout.name={config.rollout.name}"
    else:
        server = config.reward.judge.server
        engine = server.engine if server.engine in JUDGE_ENGINES else "sglang"  # a wrong engine is refused anyway
        owner, new = server, f"reward.judge.server.{engine}.engine_kwargs"
        chosen = f"reward.judge.server.engine={server.engine}"
    target = getattr(owner, engine).engine_kwargs
    target.update({k: v for k, v in kwargs.items() if k not in target})  # the new key wins where both are set
    warnings.warn(f"config key {old!r} is now per engine: {new} (for {chosen}), where these were applied; the old "
                  "name stops working in the next release", FutureWarning, stacklevel=3)


def _unknown_key_message(err: ConfigKeyError) -> str:
    full_key = str(getattr(err, "full_key", None) or err)
    if full_key in REMOVED_KEYS:
        return f"config key {full_key!r} is now {REMOVED_KEYS[full_key]}"
    known = [key for key, _, _ in describe(Config)]
    close = difflib.get_close_matches(full_key, known, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else "; see docs/config.md for every key"
    return f"unknown config key {full_key!r}{hint}"


def sections(config: Config) -> dict[str, Any]:
    """The run config's sections by name (each has a `problems()` check of its own)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def validate(config: Config) -> list[str]:
    """Every problem with a config, each saying what to change. Empty when it can run.

    Each section's own `problems()` (the agent's only with agent.enable), then the rules that span sections."""
    problems: list[str] = []
    for name, section in sections(config).items():
        if name != "agent" or config.agent.enable:
            problems += section.problems()
    return problems + cross_section_problems(config)


def cross_section_problems(config: Config) -> list[str]:
    """The rules that tie one section to another."""
    d, a, r, t = config.data, config.actor, config.rollout, config.trainer
    derived = config.derived
    problems: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    if t.val_only:
        need(bool(d.val_files), "trainer.val_only=true needs data.val_files")
    else:
        need(bool(d.train_files), "data.train_files is empty: set parquet file(s) or `synthetic`")
        need(not t.val_before_train or bool(d.val_files),
             "trainer.val_before_train=true needs data.val_files (or set trainer.val_before_train=false)")
    need(t.test_freq <= 0 or t.val_only or bool(d.val_files),
         f"trainer.test_freq={t.test_freq} needs data.val_files (or set trainer.test_freq=-1)")
    if config.algorithm.adv_estimator == "grpo":
        need(r.n >= 2, f"rollout.n={r.n}: GRPO compares samples within a group, so it needs rollout.n >= 2")
    if min(d.train_batch_size, a.ppo_mini_batch_size, a.ppo_micro_batch_size_per_gpu, r.n) >= 1:
        need(d.train_batch_size % a.ppo_mini_batch_size == 0,
             f"data.train_batch_size * rollout.n = {derived.train_batch_samples} samples do not split into "
             f"mini-batches of actor.ppo_mini_batch_size * rollout.n = {derived.mini_batch_samples}: make "
             "data.train_batch_size a multiple of actor.ppo_mini_batch_size (e.g. ppo_mini_batch_size="
             f"{_largest_divisor(d.train_batch_size, a.ppo_mini_batch_size)})")
        need(a.micro_batch_tokens > 0 or derived.mini_batch_samples % a.ppo_micro_batch_size_per_gpu == 0,
             f"a mini-batch of {derived.mini_batch_samples} samples (ppo_mini_batch_size * rollout.n) does not "
             f"split into micro-batches of actor.ppo_micro_batch_size_per_gpu={a.ppo_micro_batch_size_per_gpu}: "
             f"pick a divisor of {derived.mini_batch_samples}")
    need(a.moe.routing_replay != "engine" or bool(r.routing_capture()),
         "actor.moe.routing_replay=engine replays the rollout engine's routing, which the engine reports only with "
         "its capture on: set rollout.name=vllm and rollout.vllm.capture_routing=true (CPU or GPU), or "
         "rollout.sglang.capture_routing=true (GPU)")
    world = derived.world_size
    workers = t.async_rollout.rollout_workers if t.async_rollout.enable else 0
    need(world > 1 or workers > 0 or r.tensor_parallel_size == 1, f"rollout.tensor_parallel_size="
         f"{r.tensor_parallel_size} spans that many training workers (one device each), and this run has one: set "
         f"trainer.n_gpus_per_node x trainer.nnodes to a multiple of {r.tensor_parallel_size}, run the engines as "
         "rollout workers of their own (trainer.async_rollout.rollout_workers), or rollout.tensor_parallel_size=1")
    k = r.tensor_parallel_size
    need(k == 1 or r.name in ("vllm", "sglang"), f"rollout.tensor_parallel_size={k}: rollout.name={r.name} runs on "
         "one device; tensor parallel engines are vllm or sglang")
    need(k == 1 or not (a.lora.enabled and a.lora.may_sync_adapter), f"rollout.tensor_parallel_size={k} syncs LoRA "
         "policies as merged weights (adapters served across TP ranks are not tested yet): set actor.lora.sync=merged")
    if world > 1:
        need(derived.mini_batch_samples % world == 0,
             f"a mini-batch of {derived.mini_batch_samples} samples (ppo_mini_batch_size * rollout.n) does not split "
             f"over {world} devices (n_gpus_per_node * nnodes): make it a multiple of {world}")
        need(t.format_warmup_steps == 0, "trainer.format_warmup_steps is single-device only (it is for the embedded "
             "tiny model): set it to 0 or run on one device")
        need(r.name != "sglang-server", "rollout.name=sglang-server cannot be colocated with multi-device training: "
             "use sglang (one engine per worker) or vllm")
        need(workers > 0 or world % k == 0, f"rollout.tensor_parallel_size={k} must divide the {world} devices "
             "(n_gpus_per_node x nnodes): each colocated engine spans that many consecutive training workers")
        need(k == 1 or workers > 0 or t.engine_placement == "worker", f"trainer.engine_placement="
             f"{t.engine_placement} runs one single-device engine per node: with rollout.tensor_parallel_size={k} use "
             "engine_placement=worker")
        need(not (a.lora.enabled and a.lora.experts), f"actor.lora.experts=true runs on one device for now (PEFT's "
             "expert adapters under FSDP2 are not tested yet): set it to false, or train on one device")
    if a.lora.enabled:
        need(a.lora.sync != "adapter" or r.name in ADAPTER_BACKENDS,
             f"actor.lora.sync=adapter needs a backend that serves LoRA adapters ({list(ADAPTER_BACKENDS)}); "
             f"rollout.name={r.name} gets merged weights: set actor.lora.sync=auto or merged")
        need(r.name != "vllm" or not a.lora.may_sync_adapter or r.vllm.sleep_level == 1,
             "rollout.vllm.sleep_level=2 drops the base weights, which an adapter sync (actor.lora.sync="
             f"{a.lora.sync}) never sends again: set rollout.vllm.sleep_level=1 or actor.lora.sync=merged")
    # ---- algorithm: how rollout correction and DAPO fit the rollout, data and agent sections
    al = config.algorithm
    need(al.rollout_correction == "off" or r.temperature == 1.0,
         f"algorithm.rollout_correction={al.rollout_correction} compares the engine's logprobs with the trainer's, "
         f"which are of the same distribution only at rollout.temperature=1 (it is {r.temperature}): set "
         "rollout.temperature=1.0 or rollout_correction=off")
    processed = r.name == "vllm" and r.vllm.engine_kwargs.get("logprobs_mode") == "processed_logprobs"
    need(not processed or t.val_only or al.rollout_correction == "off",  # elsewhere the engine's start warns
         "rollout.vllm.engine_kwargs.logprobs_mode=processed_logprobs makes the engine return the logprobs of the "
         "distribution it samples from (temperature, the image/video placeholder ban, top-k/top-p), not the raw "
         f"model's, and algorithm.rollout_correction={al.rollout_correction} puts them in the loss "
         f"({'as the old logprobs' if al.rollout_correction == 'bypass' else 'in its importance weights'}): remove "
         "the key (vLLM then returns raw logprobs), or set algorithm.rollout_correction=off")
    need(al.overlong_buffer_len <= d.max_response_length,
         f"algorithm.overlong_buffer_len={al.overlong_buffer_len} must be in [0, data.max_response_length="
         f"{d.max_response_length}] (0 = off; DAPO: 4096 of 20480)")
    problems += al.distill.run_problems(world_size=world, multi_turn=config.agent.enable,
                                        temperature=r.temperature)
    need(not (al.dynamic_sampling and config.agent.enable),
         "algorithm.dynamic_sampling needs the plain rollout: the agent loop takes its prompts from a queue and carries "
         "partial groups between steps. Set algorithm.dynamic_sampling=false or agent.enable=false")
    if t.async_rollout.enable:
        problems += async_problems(config)
    elif t.async_rollout.rollout_workers > 0:
        problems.append(f"trainer.async_rollout.rollout_workers={t.async_rollout.rollout_workers} places the engines "
                        "of the asynchronous placement: set trainer.async_rollout.enable=true")
    if config.agent.enable:
        problems += agent_problems(config)
    return problems


def async_problems(config: Config) -> list[str]:
    """What the asynchronous placement (trainer.async_rollout) does not run with yet, and what it needs."""
    problems: list[str] = []
    t, r, al = config.trainer, config.rollout, config.algorithm

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    need(config.derived.world_size == 1 or t.async_rollout.rollout_workers > 0,
         "trainer.async_rollout at dp > 1 needs rollout workers of their own (the training workers' colocated "
         "engines would wait on the update): set trainer.async_rollout.rollout_workers >= 1, or "
         "trainer.n_gpus_per_node=1 and trainer.nnodes=1")
    need(not (config.derived.world_size > 1 and t.async_rollout.rollout_workers > 0 and config.actor.lora.enabled),
         "trainer.async_rollout with rollout workers at dp > 1 syncs full weights: actor.lora is not supported there "
         "yet")
    need(not (t.async_rollout.staged_sync and config.actor.lora.enabled),
         "trainer.async_rollout.staged_sync stages full weights: actor.lora syncs an adapter or the adapted layers, "
         "which staging does not copy yet; set staged_sync=false")
    need(not config.agent.enable, "trainer.async_rollout takes the plain rollout: agent.enable=true keeps its own "
         "partial rollout (agent.partial); set one of them off")
    need(not al.dynamic_sampling, "trainer.async_rollout draws one batch per step: algorithm.dynamic_sampling's "
         "extra draws need the synchronous loop")
    need(t.async_rollout.max_staleness == 0 or al.rollout_correction != "off",
         f"trainer.async_rollout.max_staleness={t.async_rollout.max_staleness}: batches sampled with older weights "
         "need the rollout importance-sampling correction against them; set algorithm.rollout_correction (e.g. "
         "token_tis) or max_staleness=0")
    need(r.vllm.enable_sleep_mode is not True and r.sglang.enable_memory_saver is not True,
         "trainer.async_rollout keeps the engine generating while the trainer updates, so it never frees its memory "
         "in between: leave rollout.vllm.enable_sleep_mode and rollout.sglang.enable_memory_saver unset")
    return problems


def agent_problems(config: Config) -> list[str]:
    """How the agent section must fit the data and rollout sections."""
    ag, d, r = config.agent, config.data, config.rollout
    out = []
    if ag.max_response_tokens > d.max_response_length:
        out.append(f"agent.max_response_tokens={ag.max_response_tokens} > data.max_response_length="
                   f"{d.max_response_length}: a trajectory must fit the padded response; lower "
                   "agent.max_response_tokens or raise data.max_response_length")
    if ag.tools and ag.max_tool_images > 0:
        if 1 + ag.max_tool_images > r.limit_images:
            out.append(f"agent.max_tool_images={ag.max_tool_images} plus the prompt's image exceeds "
                       f"rollout.limit_images={r.limit_images}: the engine would reject the conversation; raise "
                       "rollout.limit_images or lower agent.max_tool_images")
        if d.max_pixels is not None:  # else checked with the model's bound (check_model_context)
            out += tool_image_problems(config, d.max_pixels, f"data.max_pixels={d.max_pixels}")
    return out


def tool_image_problems(config: Config, max_pixels: int, where: str) -> list[str]:
    """One tool image must leave room in the response budget."""
    ag, d = config.agent, config.data
    if not (config.agent.enable and ag.tools and ag.max_tool_images > 0):
        return []
    image_tokens = max_pixels // IMAGE_PATCH_PIXELS
    budget = min(ag.max_response_tokens, d.max_response_length)
    if image_tokens < budget:
        return []
    return [f"one tool image at {where} takes up to {image_tokens} response tokens, the whole response budget of "
            f"{budget}: lower data.max_pixels, raise agent.max_response_tokens and data.max_response_length, or set "
            "agent.max_tool_images=0"]


def _largest_divisor(total: int, at_most: int) -> int:
    return max(k for k in range(1, min(total, at_most) + 1) if total % k == 0)


def check_model_context(config: Config) -> list[str]:
    """Check prompt + response lengths fit the model's context, and that a routing capture asks a model that routes
    (`RolloutConfig.routing_capture`), for local folders and embedded models. Hub ids that are not downloaded are
    skipped (the engine checks again when it loads them)."""
    from vlmrl.models.families import family_of
    from vlmrl.models.tiny import is_embedded, is_hub_id, resolve_model_path

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
    split = tensor_parallel_problems(config.rollout.tensor_parallel_size, model_config, path)
    if split:
        return split
    if config.rollout.routing_capture():  # the family says whether the model routes through experts
        try:
            family = family_of(model_config)
        except ValueError as err:
            return [f"actor.model_path={path!r}: {err}"]
        if family.experts is None:
            return [config.rollout.dense_routing_capture(f"{path} ({family.name})")]
    context = model_config.get("text_config", {}).get("max_position_embeddings") or model_config.get(
        "max_position_embeddings")
    total = config.derived.max_model_len
    if context and total > context:
        return [f"data.max_prompt_length + data.max_response_length = {total} exceeds the model's context of {context} "
                f"tokens ({path}): lower one of them"]
    from vlmrl.processors.bounds import model_bound_problems

    bounds = model_bound_problems(config.data, config_file.parent)  # what the processor would refuse as it loads
    if bounds:
        return bounds
    model_max_pixels = _model_max_pixels(config_file.parent)
    if config.data.max_pixels is None and model_max_pixels:
        return tool_image_problems(config, model_max_pixels, f"the model's max_pixels={model_max_pixels} "
                                   "(data.max_pixels=null)")
    return []


def tensor_parallel_problems(k: int, model_config: dict, path: str) -> list[str]:
    """A model an engine cannot split over `k` tensor-parallel ranks: its attention heads (query and key/value, of
    the language model and of the vision tower) must divide by k (vLLM and SGLang shard whole heads; KV heads fewer
    than k are replicated, so those must divide k instead).

    >>> tensor_parallel_problems(2, {"text_config": {"num_attention_heads": 3, "num_key_value_heads": 1}}, "m")[0][:60]
    'rollout.tensor_parallel_size=2 does not split the language m'
    >>> tensor_parallel_problems(4, {"text_config": {"num_attention_heads": 8, "num_key_value_heads": 2}}, "m")
    []
    """
    if k == 1:
        return []
    problems = []
    for part, section in (("language model", model_config.get("text_config") or model_config),
                          ("vision tower", model_config.get("vision_config") or {})):
        heads = section.get("num_attention_heads") or section.get("num_heads")
        kv = section.get("num_key_value_heads") or heads
        if heads and heads % k:
            problems.append(f"rollout.tensor_parallel_size={k} does not split the {part}'s {heads} attention heads "
                            f"({path}): pick a divisor of {heads}")
        elif kv and kv % k and k % kv:
            problems.append(f"rollout.tensor_parallel_size={k} does not split the {part}'s {kv} key/value heads "
                            f"({path}): pick a divisor or a multiple of {kv}")
    return problems


def _model_max_pixels(folder: Path) -> int | None:
    """The image processor's upper pixel bound (`size.longest_edge`), what data.max_pixels=null resizes to."""
    for name in ("preprocessor_config.json", "processor_config.json"):
        if (folder / name).exists():
            processor = json.loads((folder / name).read_text())
            processor = processor.get("image_processor", processor)
            bound = processor.get("size", {}).get("longest_edge") or processor.get("max_pixels")
            return int(bound) if bound else None
    return None


def to_dict(config: Config) -> dict[str, Any]:
    """Plain nested dict (for artifacts, checkpoints and W&B)."""
    return dataclasses.asdict(config)


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


# ---- the documentation of every key, read from the dataclasses (scripts/gen_config_docs.py writes it out) ----------


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each field of a dataclass (read from its source)."""
    docs: dict[str, str] = {}
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body  # type: ignore[attr-defined]
    for node, following in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(following, ast.Expr) and isinstance(getattr(following, "value", None), ast.Constant):
                docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs


def describe(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default as yaml text, docstring) for every leaf field, in declaration order, sub-sections
    after their section's own keys."""
    rows, nested = [], []
    docs = field_docs(cls)
    instance = cls()
    for f in dataclasses.fields(cls):
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(value):
            nested += describe(type(value), prefix=f"{prefix}{f.name}.")
        else:
            rows.append((f"{prefix}{f.name}", json.dumps(value), docs.get(f.name, "")))
    return rows + nested


USAGE = """\
python -m vlmrl.config [config=FILE.yaml] [key=value ...]   print the resolved config as YAML (exit 2 if invalid)
python scripts/gen_config_docs.py                        rewrite the reference of every key (docs/config.md)"""


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] in (["-h"], ["--help"]):
        print(USAGE)
    else:
        try:
            print(to_yaml(load_config(sys.argv[1:])), end="")
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
