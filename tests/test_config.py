"""Config: yaml + dotted overrides, typed values, invalid combinations rejected with what to change, docs current."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from vlmrl.config import Config, ConfigError, RolloutConfig, describe, load_config, sections, to_yaml, validate

ROOT = Path(__file__).resolve().parents[1]
BASE = ["actor.model_path=tiny", "data.train_files=synthetic", "data.val_files=synthetic",
        "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4",
        "data.max_prompt_length=256", "data.max_response_length=64"]


def load(*overrides: str, check_model: bool = False) -> Config:
    return load_config(BASE + list(overrides), check_model=check_model)


def problems_of(*overrides: str, check_model: bool = False) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides, check_model=check_model)
    return str(info.value)


def test_yaml_then_dotted_overrides_in_order(tmp_path):
    yaml = tmp_path / "run.yaml"
    yaml.write_text("rollout:\n  n: 4\n  temperature: 0.7\nactor:\n  optim:\n    lr: 3.0e-4\n")
    config = load_config([f"config={yaml}"] + BASE + ["rollout.n=8", "trainer.logger=[console,tensorboard]"],
                         check_model=False)
    assert config.rollout.n == 8 and config.rollout.temperature == 0.7
    assert config.actor.optim.lr == pytest.approx(3e-4)
    assert config.trainer.logger == ["console", "tensorboard"]
    assert isinstance(config.actor.optim, type(Config().actor.optim))


def test_round_trip_through_yaml(tmp_path):
    config = load("rollout.n=3", "trainer.total_steps=7")
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(to_yaml(config))
    assert load_config([f"config={dumped}"], check_model=False) == config


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.temprature'; did you mean 'rollout.temperature'"):
        load("rollout.temprature=0.5")


def test_wrong_type_names_the_argument():
    with pytest.raises(ConfigError, match=r"bad value in 'rollout.n=many'"):
        load("rollout.n=many")


def test_missing_yaml_file_is_named():
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(["config=nope.yaml"])


@pytest.mark.parametrize("value", ["Question: {question}\nAnswer: {response}\nRate it: [[N]]", "Rate: it\n  line: two",
                                   "a: b: c"])
def test_a_text_value_the_command_line_cannot_read_is_one_error_line_naming_the_key(value, tmp_path, capsys):
    """A multi-line judge template on the command line (read as YAML there) ends python -m vlmrl.train with one
    `error:` line naming the key and where such text goes (exit 2), as other config errors do, not a YAML
    traceback; the same text in a config file loads."""
    from vlmrl.train import main

    assert main([f"reward.judge.template={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "reward.judge.template" in err and "config file" in err, err
    assert "Traceback" not in err
    overlay = tmp_path / "judge.yaml"
    overlay.write_text("reward:\n  judge:\n    template: |\n" + "".join(f"      {line}\n" for line in value.split("\n")))
    config = load_config([f"config={overlay}", "actor.model_path=tiny", "data.train_files=synthetic",
                          "data.val_files=synthetic"])
    assert config.reward.judge.template == value + "\n"


def test_argument_without_equals_is_rejected():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(["rollout.n"])


def test_batch_that_does_not_split_into_mini_batches_says_what_to_change():
    message = problems_of("data.train_batch_size=10", "actor.ppo_mini_batch_size=4")
    assert "data.train_batch_size * rollout.n = 50" in message
    assert "ppo_mini_batch_size=2" in message


def test_micro_batch_must_divide_the_mini_batch():
    message = problems_of("actor.ppo_micro_batch_size_per_gpu=3")
    assert "a mini-batch of 20 samples" in message and "ppo_micro_batch_size_per_gpu=3" in message


def test_kl_coefficient_without_reference_and_reference_without_coefficient():
    assert "set actor.use_kl_loss=true, or kl_loss_coef=0" in problems_of("actor.kl_loss_coef=0.01")
    assert "loads a reference model for nothing" in problems_of("actor.use_kl_loss=true")
    config = load("actor.use_kl_loss=true", "actor.kl_loss_coef=0.01")
    assert config.actor.kl_loss_type == "low_var_kl"


def test_every_problem_is_listed_at_once():
    message = problems_of("rollout.n=1", "rollout.name=tgi", "actor.kl_loss_type=k9", "trainer.logger=[mlflow]")
    for fragment in ("rollout.n >= 2", "rollout.name='tgi'", "kl_loss_type='k9'", "['mlflow']"):
        assert fragment in message


def test_greedy_validation_with_several_samples_is_rejected():
    assert "identical greedy samples" in problems_of("rollout.val_n=4")
    assert load("rollout.val_n=4", "rollout.val_temperature=1.0").rollout.val_n == 4


def test_validation_settings_need_validation_data():
    assert "needs data.val_files" in problems_of("data.val_files=")
    assert "trainer.val_only=true needs data.val_files" in problems_of("data.val_files=", "trainer.val_only=true")
    config = load("data.val_files=", "trainer.val_before_train=false", "trainer.test_freq=-1")
    assert config.data.val_files == ""


def test_validate_only_needs_no_training_data():
    config = load("data.train_files=", "trainer.val_only=true")
    assert config.trainer.val_only


def test_model_path_is_required():
    assert "actor.model_path is empty" in problems_of("actor.model_path=")


def test_lengths_over_the_model_context_are_rejected(tiny_model_path):
    message = problems_of("data.max_prompt_length=4000", "data.max_response_length=2048", check_model=True)
    assert "6048 exceeds the model's context of 4096" in message
    assert load("data.max_prompt_length=2048", check_model=True).data.max_prompt_length == 2048


def test_every_field_has_a_docstring():
    undocumented = [key for key, _, doc in describe(Config) if not doc]
    assert not undocumented, f"fields without a docstring: {undocumented}"


def _docs_generator():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_config_md_is_current():
    path = ROOT / "docs" / "config.md"
    assert path.read_text() == _docs_generator().markdown(), "docs/config.md is stale: run scripts/gen_config_docs.py"


def test_verl_style_keys_exist():
    keys = {key for key, _, _ in describe(Config)}
    for key in ("data.train_files", "data.val_files", "data.train_batch_size", "data.max_prompt_length",
                "data.max_response_length", "data.min_pixels", "data.max_pixels", "actor.model_path", "actor.optim.lr",
                "actor.ppo_mini_batch_size", "actor.ppo_micro_batch_size_per_gpu", "actor.clip_ratio",
                "actor.entropy_coeff", "actor.kl_loss_coef", "actor.kl_loss_type", "actor.grad_clip", "rollout.name",
                "rollout.n", "rollout.temperature", "rollout.top_p", "rollout.val_temperature", "rollout.val_n",
                "algorithm.norm_adv_by_std_in_grpo", "reward.function", "trainer.total_steps", "trainer.total_epochs",
                "trainer.val_before_train", "trainer.test_freq", "trainer.val_only", "trainer.save_freq",
                "trainer.max_ckpt_to_keep", "trainer.output_dir", "trainer.seed", "trainer.logger"):
        assert key in keys, key


def test_multi_device_settings_are_checked():
    message = problems_of("trainer.n_gpus_per_node=3", "trainer.format_warmup_steps=5")
    assert "does not split over 3 devices" in message and "format_warmup_steps is single-device only" in message
    assert load("trainer.n_gpus_per_node=2").trainer.n_gpus_per_node == 2


@pytest.mark.parametrize("name", ["geo3k_check_answer.yaml", "geo3k_zoom.yaml"])
def test_agent_examples_load_as_run_configs(name):
    config = load_config([f"config={ROOT / 'examples' / 'agent' / name}"], check_model=False)
    assert config.agent.enable and config.agent.tools
    assert config.agent.max_response_tokens <= config.data.max_response_length


def test_agent_section_is_checked_at_load():
    agent = ["agent.enable=true", "agent.tools=[{path: 'vlmrl.agent.builtin:ImageZoomTool'}]",
             "agent.max_response_tokens=64", "data.max_pixels=12544"]  # a tool image: at most 16 tokens
    assert load(*agent).agent.tools[0].path == "vlmrl.agent.builtin:ImageZoomTool"
    assert "agent.max_turns=0: must be >= 1" in problems_of(*agent, "agent.max_turns=0")
    assert "agent.partial.unfinished='keep'" in problems_of(*agent, "agent.partial.unfinished=keep")
    # a trajectory longer than the padded response cannot be stored
    assert "agent.max_response_tokens=128 > data.max_response_length=64" in problems_of(
        *agent, "agent.max_response_tokens=128")
    # prompt image + tool images must fit the engine's per-request image limit
    assert "rollout.limit_images=4" in problems_of(*agent, "agent.max_tool_images=4", "rollout.limit_images=4")
    # one tool image at data.max_pixels (1280 tokens by default) cannot fit a 64-token response
    assert "takes up to 1280 response tokens" in problems_of(*agent, "data.max_pixels=1003520")
    assert load(*agent, "agent.max_tool_images=0", "data.max_pixels=1003520").agent.max_tool_images == 0
    # off: the agent section's limits do not apply
    assert not load("agent.max_response_tokens=4096").agent.enable


def test_a_tool_image_at_the_models_max_pixels_is_checked_when_data_max_pixels_is_null(tiny_model_path):
    agent = ["agent.enable=true", "agent.tools=[{path: 'vlmrl.agent.builtin:ImageZoomTool'}]",
             "agent.max_response_tokens=16"]  # the tiny model's 12544 pixels: 16 image tokens
    assert "one tool image at the model's max_pixels=12544" in problems_of(*agent, check_model=True)
    assert load(*agent, "agent.max_response_tokens=17", check_model=True).data.max_pixels is None


def test_image_safety_keys_are_the_processors(tmp_path, tiny_model_path):
    """The data section IS the processor's config: nothing is copied between them."""
    from vlmrl.data.config import DataConfig
    from vlmrl.processors.loading import load_processor

    config = load("data.on_bad_image=filter", f"data.data_root={tmp_path}", "data.allow_remote_images=true",
                  "data.remote_timeout_s=2.5", "data.remote_max_bytes=1024", "data.max_image_pixels=2000000",
                  "data.filter_overlong_prompts=false")
    assert isinstance(config.data, DataConfig)
    processor = load_processor(tiny_model_path, config.data)
    assert processor.config is config.data and not processor.config.filter_overlong_prompts
    limits = processor.config
    assert (limits.data_root, limits.allow_remote_images, limits.remote_timeout_s, limits.remote_max_bytes,
            limits.max_image_pixels) == (str(tmp_path), True, 2.5, 1024, 2000000)
    assert load().data.data_root is None and not load().data.allow_remote_images
    assert "data.on_bad_image='skip'" in problems_of("data.on_bad_image=skip")
    assert "data.remote_max_bytes=0 must be > 0" in problems_of("data.remote_max_bytes=0")
    assert "raise data.max_image_pixels" in problems_of("data.max_pixels=12544", "data.max_image_pixels=1000")


def test_engine_neutral_options_reach_every_backend_and_deadlines_must_be_positive():
    from vlmrl.rollout.registry import backend_options

    base = ["actor.model_path=org/m", "data.train_files=synthetic", "data.val_files=synthetic"]
    config = load_config([*base, "rollout.start_timeout_s=1800", "rollout.timeout_s=900",
                          "rollout.gpu_memory_utilization=0.4", "data.max_prompt_length=100",
                          "data.max_response_length=28", "trainer.seed=7"])
    assert config.derived.max_model_len == 128
    for name in ("hf", "vllm", "sglang", "sglang-server"):
        options = backend_options(config.rollout, name, max_model_len=config.derived.max_model_len, seed=7)
        r = options.rollout
        assert (r.start_timeout_s, r.timeout_s, options.max_model_len, options.seed) == (1800, 900, 128, 7)
        assert r.gpu_memory_utilization == 0.4
    with pytest.raises(ConfigError, match=r"rollout.start_timeout_s=0.0 must be > 0"):
        load_config([*base, "rollout.start_timeout_s=0"])


def test_a_model_folder_that_does_not_exist_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"actor.model_path='.*nope': no such folder"):
        load_config([f"actor.model_path={tmp_path / 'nope'}", "data.train_files=synthetic",
                     "data.val_files=synthetic"])


def test_an_engine_that_is_not_installed_is_named_at_config_load(monkeypatch):
    """Found before data loading and the actor's weights (minutes on a 7B), with what to install."""
    import sys

    monkeypatch.setitem(sys.modules, "sglang", None)  # what importlib sees when the package is absent
    base = ["actor.model_path=org/m", "data.train_files=synthetic", "data.val_files=synthetic"]
    with pytest.raises(ConfigError, match=r"rollout.name=sglang needs sglang, which is not installed.*\.\[sglang\]"):
        load_config([*base, "rollout.name=sglang"])
    load_config([*base, "rollout.name=sglang-server", "rollout.server.url=http://127.0.0.1:30000"])  # a client only


def test_tensor_parallel_engines_span_a_divisor_of_the_training_workers(tiny_model_path):
    """rollout.tensor_parallel_size = k colocated: k consecutive training workers host one engine, so k must divide
    the devices; rollout workers of their own take any k. What cannot run is refused at load, naming the key, before
    anything starts."""
    base = ["actor.model_path=org/m", "data.train_files=synthetic", "data.val_files=synthetic",
            "trainer.n_gpus_per_node=4", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=2",
            "trainer.format_warmup_steps=0", "rollout.name=vllm"]
    load_config([*base, "rollout.tensor_parallel_size=2"], check_model=False)
    load_config([*base, "rollout.tensor_parallel_size=4", "rollout.name=sglang"], check_model=False)
    refusals = {
        "rollout.tensor_parallel_size=3 must divide the 4 devices": ["rollout.tensor_parallel_size=3"],
        "spans that many training workers .* and this run has one": [
            "rollout.tensor_parallel_size=2", "trainer.n_gpus_per_node=1"],
        "engine_placement=node runs one single-device engine per node": [
            "rollout.tensor_parallel_size=2", "trainer.engine_placement=node"],
        "rollout.name=hf runs on one device": ["rollout.tensor_parallel_size=2", "rollout.name=hf"],
        "rollout.name=hf runs on one device; tensor parallel engines are vllm or sglang": [
            "rollout.tensor_parallel_size=2", "rollout.name=hf", "trainer.n_gpus_per_node=1",
            "trainer.async_rollout.enable=true", "trainer.async_rollout.rollout_workers=1"],
    }
    for message, keys in refusals.items():
        with pytest.raises(ConfigError, match=message):
            load_config([*base, *keys], check_model=False)
    # rollout workers of their own: each engine at TP k on a placement group of its own, whatever the training
    # workers (one, or a count k does not divide)
    for devices in ("1", "3"):
        load_config([*base, "rollout.tensor_parallel_size=2", f"trainer.n_gpus_per_node={devices}",
                     "data.train_batch_size=24", "actor.ppo_mini_batch_size=6", "trainer.async_rollout.enable=true",
                     "trainer.async_rollout.max_staleness=0", "trainer.async_rollout.rollout_workers=2"],
                    check_model=False)
    # the model must split: tiny has 2 attention heads
    with pytest.raises(ConfigError, match=r"rollout.tensor_parallel_size=4 does not split the language model's 2 "
                                          r"attention heads"):
        load_config([*base, f"actor.model_path={tiny_model_path}", "rollout.tensor_parallel_size=4"])
    load_config([*base, f"actor.model_path={tiny_model_path}", "rollout.tensor_parallel_size=2"])


def test_a_tensor_parallel_refusal_is_one_error_line_before_any_engine(tiny_model_path, tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "vlmrl.train", f"actor.model_path={tiny_model_path}",
                           "data.train_files=synthetic", "trainer.n_gpus_per_node=2", "rollout.tensor_parallel_size=4",
                           f"trainer.output_dir={tmp_path}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "error: invalid configuration:" in done.stderr
    assert "rollout.tensor_parallel_size=4 must divide the 2 devices" in done.stderr
    assert not (tmp_path / "engine.log").exists()


def test_a_renamed_key_names_its_new_name(tmp_path):
    with pytest.raises(ConfigError, match=r"'data.on_overlong' is now data.filter_overlong_prompts"):
        load("data.on_overlong=error")
    yaml = tmp_path / "old.yaml"
    yaml.write_text("data:\n  on_overlong: filter\n")
    with pytest.raises(ConfigError, match=r"'data.on_overlong' is now data.filter_overlong_prompts"):
        load_config([f"config={yaml}"], check_model=False)


def test_keys_of_the_last_release_still_work_with_a_warning(tmp_path):
    """rollout.server_url and the one rollout.engine_kwargs moved into the per-engine sections; a config written for
    the last release runs unchanged for one more, and says what to rename."""
    with pytest.warns(FutureWarning, match=r"'rollout.server_url' \(in rollout.server_url=http://h:1\) is now "
                                           r"'rollout.server.url'"):
        config = load("rollout.name=sglang-server", "rollout.server_url=http://h:1")
    assert config.rollout.server.url == "http://h:1"
    yaml = tmp_path / "old.yaml"
    yaml.write_text("rollout:\n  name: sglang\n  engine_kwargs:\n    chunked_prefill_size: 512\n")
    with pytest.warns(FutureWarning, match=r"rollout.sglang.engine_kwargs \(for rollout.name=sglang\)"):
        config = load(f"config={yaml}")
    assert config.rollout.sglang.engine_kwargs == {"chunked_prefill_size": 512}
    assert config.rollout.vllm.engine_kwargs == {}, "only the engine the run uses gets them"
    with pytest.warns(FutureWarning, match=r"rollout.vllm.engine_kwargs \(for rollout.name=vllm\)"):
        config = load("rollout.engine_kwargs={max_num_seqs: 4}", "rollout.vllm.engine_kwargs={max_num_seqs: 8}")
    assert config.rollout.vllm.engine_kwargs == {"max_num_seqs": 8}, "the new key wins where both are set"
    with pytest.warns(FutureWarning, match=r"rollout.sglang.engine_kwargs \(for rollout.name=sglang-server\)"):
        assert load("rollout.engine_kwargs={x: 1}", "rollout.name=sglang-server").rollout.sglang.engine_kwargs == {"x": 1}


def test_every_engine_option_is_a_run_config_key():
    """Each option a backend takes (the LoRA-derived ones and what the run derives excepted) is set from the run
    config, and the backend starts from that value."""
    from vlmrl.rollout.config import BACKEND_SECTIONS, ENGINE_OPTIONS, SERVING_OPTIONS
    from vlmrl.rollout.registry import backend_options

    sample = {bool: lambda v: not v if v is not None else True, int: lambda v: (v or 0) + 3,
              float: lambda v: (v or 0.0) + 0.25, str: lambda v: "x" + (v or ""), dict: lambda v: {"k": 1}}
    for name, sections_ in BACKEND_SECTIONS.items():
        keys = [k for k in ENGINE_OPTIONS if name != "hf" or k not in SERVING_OPTIONS]
        keys += [f"{section}.{f.name}" for section in sections_
                 for f in dataclasses.fields(type(getattr(RolloutConfig(), section)))]
        for key in keys:
            default = OmegaConf_select(RolloutConfig(), key)
            kind = next(t for t in (bool, int, float, str, dict) if isinstance(default, t) or (
                default is None and t in _annotation_types(key)))
            value = sample[kind](default)
            config = Config(rollout=RolloutConfig(name=name))
            _set(config.rollout, key, value)
            options = backend_options(config.rollout, name, max_model_len=64, seed=1)
            assert OmegaConf_select(options.rollout, key) == value, f"{name}: rollout.{key}"


def OmegaConf_select(obj, dotted: str):  # noqa: N802 - reads like the library call it stands for
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _set(obj, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part)
    setattr(obj, leaf, value)


def _annotation_types(dotted: str) -> tuple[type, ...]:
    """The types a field of RolloutConfig (or a sub-section) admits, from its annotation text."""
    import typing

    *parents, leaf = dotted.split(".")
    cls = RolloutConfig
    for part in parents:
        cls = type(getattr(cls(), part))
    hint = typing.get_type_hints(cls)[leaf]
    return tuple(a for a in typing.get_args(hint) if a is not type(None)) or (hint,)


def _dataclasses_under(cls: type) -> list[type]:
    """The section dataclasses composed under cls, nested sub-sections included."""
    found = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            found += [type(default), *_dataclasses_under(type(default))]
    return list(dict.fromkeys(found))


def test_sections_are_composed_not_inherited():
    """Every key is declared in the one section that holds it: no section inherits another's fields (a knob that
    only an inherited options class had could not be set from a run)."""
    classes = [Config, *_dataclasses_under(Config)]
    for klass in classes:
        bases = [k.__name__ for k in klass.__mro__[1:] if dataclasses.is_dataclass(k)]
        assert not bases, f"{klass.__name__} inherits config fields from {bases}"
    names = {k.__name__ for k in classes}
    assert {"VLLMConfig", "SGLangConfig", "ServerConfig", "HFConfig", "LoraConfig", "DataConfig"} <= names


def test_derived_values_are_computed_in_one_place():
    config = load("data.max_prompt_length=300", "data.max_response_length=40", "data.train_batch_size=8",
                  "actor.ppo_mini_batch_size=4", "rollout.n=3")
    d = config.derived
    assert (d.max_model_len, d.mini_batch_samples, d.train_batch_samples, d.world_size) == (340, 12, 24, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.max_model_len = 1  # derived, never set
    assert "derived" not in to_yaml(config), "derived values are not config keys"


def test_kl_types_and_policies_are_defined_once():
    from vlmrl.actor import config as actor_config
    from vlmrl.algorithms import config as algorithms_config
    from vlmrl.algorithms import grpo

    assert grpo.KL_TYPES is algorithms_config.KL_TYPES is actor_config.KL_TYPES


def test_each_section_reports_its_own_problems_and_validate_adds_only_cross_section_ones():
    config = load()
    config.data.on_bad_image, config.actor.kl_loss_type, config.rollout.val_n = "skip", "k9", 0
    config.algorithm.adv_estimator, config.reward.num_workers, config.trainer.nnodes = "ppo", 0, 0
    config.agent.enable, config.agent.max_turns, config.agent.max_response_tokens = True, 0, 64
    config.data.val_files = ""  # a cross-section rule: validation needs data
    reported = validate(config)
    own = []
    for name, section in sections(config).items():
        problems = section.problems()
        assert problems and all(problem.startswith(f"{name}.") for problem in problems), (name, problems)
        assert [p for p in reported if p in problems] == problems, name
        own += problems
    assert [p for p in reported if p not in own] == ["trainer.val_before_train=true needs data.val_files (or set "
                                                      "trainer.val_before_train=false)",
                                                      "trainer.test_freq=5 needs data.val_files (or set "
                                                      "trainer.test_freq=-1)"]


def test_importing_the_run_config_imports_no_torch():
    code = "import sys, vlmrl.config; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0, "vlmrl.config imported torch"


def test_config_cli_prints_a_resolved_config_and_help():
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "vlmrl.config", *args], cwd=ROOT, capture_output=True, text=True)

    assert "scripts/gen_config_docs.py" in run("--help").stdout
    resolved = run(*BASE, "rollout.temperature=0.7")
    assert resolved.returncode == 0 and "temperature: 0.7" in resolved.stdout
    assert run(*BASE, "rollout.n=1").returncode == 2


def test_the_algorithm_names_are_defined_once():
    # the torch-free config leaf defines the names; the math accepts exactly those
    from vlmrl.algorithms import advantages, aggregation, config, correction, policy_loss

    assert config.ADV_ESTIMATORS is advantages.ADV_ESTIMATORS
    assert config.LOSS_AGG_MODES is aggregation.LOSS_AGG_MODES
    assert config.POLICY_LOSSES is policy_loss.POLICY_LOSSES
    assert config.ROLLOUT_CORRECTIONS is correction.ROLLOUT_CORRECTIONS
    assert config.SEQ_RATIOS is correction.SEQ_RATIOS


def test_every_estimator_loss_and_mode_loads():
    from vlmrl.algorithms.config import ADV_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES, ROLLOUT_CORRECTIONS

    for name in ADV_ESTIMATORS:
        assert load(f"algorithm.adv_estimator={name}").algorithm.adv_estimator == name
    for mode in LOSS_AGG_MODES:
        assert load(f"actor.loss_agg_mode={mode}").actor.loss_agg_mode == mode
    for loss in POLICY_LOSSES:
        assert load(f"actor.policy_loss={loss}", "actor.clip_ratio_low=3e-4", "actor.clip_ratio_high=4e-4"
                    ).actor.policy_loss == loss
    for correction in ROLLOUT_CORRECTIONS:
        assert load(f"algorithm.rollout_correction={correction}").algorithm.rollout_correction == correction
    dapo = load("algorithm.dynamic_sampling=true", "algorithm.overlong_buffer_len=4", "algorithm.mask_truncated=true")
    assert dapo.algorithm.dynamic_sampling and dapo.algorithm.overlong_buffer_len == 4


def test_loss_and_algorithm_settings_are_checked_at_load():
    message = problems_of("algorithm.adv_estimator=ppo", "actor.loss_agg_mode=seq-mean", "actor.policy_loss=dpo",
                          "algorithm.rollout_correction=tis", "actor.clip_ratio_c=1.0",
                          "algorithm.overlong_buffer_len=100000", "algorithm.dynamic_sampling_max_extra_draws=-1")
    for fragment in ("algorithm.adv_estimator='ppo'", "actor.loss_agg_mode='seq-mean'", "actor.policy_loss='dpo'",
                     "algorithm.rollout_correction='tis'", "actor.clip_ratio_c=1.0 must be > 1",
                     "algorithm.overlong_buffer_len=100000", "dynamic_sampling_max_extra_draws=-1"):
        assert fragment in message, fragment
    # Dr. GRPO's switch is grpo's: compute_advantages would raise mid-run
    assert "applies to adv_estimator=grpo only" in problems_of("algorithm.adv_estimator=rloo",
                                                               "algorithm.norm_adv_by_std_in_grpo=false")
    # GSPO's sequence ratio needs its own, far narrower clip range
    assert "GSPO paper: 3e-4 and 4e-4" in problems_of("actor.policy_loss=gspo")
    # SAPO divides by its temperatures, and only SAPO is given them
    assert "actor.sapo_tau_neg=0.0 must be > 0" in problems_of("actor.policy_loss=sapo", "actor.sapo_tau_neg=0")
    sapo = load("actor.policy_loss=sapo", "actor.sapo_tau_pos=0.5", "actor.clip_ratio_high=0.28").actor
    assert sapo.policy_loss_kwargs() == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0,
                                         "tau_pos": 0.5, "tau_neg": 1.05}
    assert "tau_pos" not in load().actor.policy_loss_kwargs()
    # Seq-MIS weighs by the product ratio; a band on the geometric mean is Geo-RS, a rejection mode
    assert "set algorithm.rollout_correction=seq_rs" in problems_of("algorithm.rollout_correction=seq_mis",
                                                                    "algorithm.rollout_correction_seq_ratio=geometric")
    assert load("algorithm.rollout_correction=seq_rs", "algorithm.rollout_correction_seq_ratio=geometric")
    assert "IcePop: 0.5 and 5.0" in problems_of("algorithm.rollout_correction=token_icepop",
                                                "algorithm.rollout_correction_token_high=0.9")
    # engine logprobs are of the untempered distribution
    assert "rollout.temperature=1" in problems_of("algorithm.rollout_correction=token_tis", "rollout.temperature=0.7")
    # the agent loop takes prompts from a queue and carries groups: no dynamic sampling there
    assert "dynamic_sampling needs the plain rollout" in problems_of("algorithm.dynamic_sampling=true",
                                                                     "agent.enable=true")


@pytest.mark.parametrize("recipe", ["dapo", "gspo"])
def test_the_recipe_overlays_load_on_the_geo3k_recipe_and_on_the_demo(recipe):
    configs = ROOT / "examples" / "configs"
    overlay = f"config={configs / f'qwen2_5_vl_geo3k_{recipe}.yaml'}"
    real = load_config([f"config={configs / 'qwen2_5_vl_geo3k.yaml'}", overlay], check_model=False)
    assert real.actor.policy_loss == ("gspo" if recipe == "gspo" else "ppo-clip") and not real.actor.use_kl_loss
    assert real.data.max_response_length == 2048  # the overlay keeps the geo3k recipe's lengths
    # examples/qwen2_5_vl_grpo.sh RECIPE=... on the demo: overlay first, the demo's settings after it
    demo_args = [overlay, f"config={configs / 'tiny_synthetic.yaml'}", "rollout.name=hf"]
    demo = load_config(demo_args + (["algorithm.overlong_buffer_len=1"] if recipe == "dapo" else []),
                       check_model=False)
    assert demo.data.train_batch_size == 16 and demo.actor.loss_agg_mode == real.actor.loss_agg_mode
    assert (demo.actor.clip_ratio_low, demo.actor.clip_ratio_high) == (real.actor.clip_ratio_low,
                                                                       real.actor.clip_ratio_high)


def _refused_by_the_cli(capsys, *overrides: str) -> str:
    """`python -m vlmrl.train` on BASE + overrides, in this process: exit status 2 at load (`main` returns before
    it imports the trainer or an engine), one `error:` line with the config's problems listed under it; returns the
    output."""
    from vlmrl.train import main

    assert main([*BASE, *overrides]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == ["error: invalid configuration:"], err
    assert "Traceback" not in err
    return err


PROCESSED = "rollout.vllm.engine_kwargs.logprobs_mode=processed_logprobs"


@pytest.mark.vllm  # rollout.name=vllm loads where vLLM is installed
@pytest.mark.parametrize(("correction", "use"), [("bypass", "as the old logprobs"),
                                                 ("token_tis", "in its importance weights")])
def test_processed_logprobs_are_refused_where_the_loss_takes_the_engines(capsys, tmp_path, correction, use):
    """vLLM set to return processed logprobs (of the distribution it samples from, not the raw model's) is refused
    where the loss takes the engine's logprobs: rollout correction's bypass as the old logprobs, every other
    correction in its weights. Where no loss does (correction off, validate-only) the run loads, and the engine
    warns at its start (tests/rollout/test_vllm_logprobs_mode.py)."""
    err = _refused_by_the_cli(capsys, "rollout.name=vllm", PROCESSED, f"algorithm.rollout_correction={correction}",
                              f"trainer.output_dir={tmp_path}")
    assert f"{PROCESSED} makes the engine return the logprobs of the distribution it samples from" in err
    assert f"algorithm.rollout_correction={correction} puts them in the loss ({use}): remove the key" in err
    assert not (tmp_path / "engine.log").exists(), "the engines' log was opened: the run went past its config"
    load("rollout.name=vllm", PROCESSED)
    load("rollout.name=vllm", PROCESSED, f"algorithm.rollout_correction={correction}", "trainer.val_only=true")
    load("rollout.name=vllm", "rollout.vllm.engine_kwargs.logprobs_mode=raw_logprobs",
         f"algorithm.rollout_correction={correction}")


@pytest.mark.vllm
@pytest.mark.sglang
@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_routing_capture_on_a_dense_model_is_refused(capsys, tmp_path, tiny_model_path, backend):
    """rollout.<engine>.capture_routing records a Mixture-of-Experts model's routing; on a dense model it did nothing,
    silently: refused at load, naming the key and the model's family. A MoE model, or a backend that runs another
    engine than the key's, loads."""
    key = f"rollout.{backend}.capture_routing"
    err = _refused_by_the_cli(capsys, f"rollout.name={backend}", f"{key}=true", f"trainer.output_dir={tmp_path}")
    assert f"{key}=true records which experts a Mixture-of-Experts model routes each token through, and tiny " \
           f"(Qwen2.5-VL) is a dense model: it has none, so nothing would be recorded; set {key}=false" in err
    assert not (tmp_path / "engine.log").exists()
    moe = load("actor.model_path=tiny-qwen3-vl-moe", f"rollout.name={backend}", f"{key}=true", check_model=True)
    assert moe.rollout.routing_capture() == key
    assert load("rollout.name=hf", f"{key}=true", check_model=True).rollout.routing_capture() == ""
