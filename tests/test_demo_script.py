"""examples/qwen2_5_vl_grpo.sh picks the run from MODEL_PATH: an embedded name runs the demo on that model, a Qwen3-VL
model (by its config.json, or by a hub id's name) takes the Qwen3-VL geo3k recipe; RECIPE adds the algorithm and LoRA
overlays, and every key=value argument goes through. DRY_RUN=1 prints the command; the printed arguments must load as
a config (and, for the demo, build the processor the run would build)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vlmrl.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def launch(*args: str, **env: str) -> subprocess.CompletedProcess:
    """The launcher in DRY_RUN, without its memory plan (PLAN=0: seconds per run; one test below keeps it)."""
    return subprocess.run(["bash", "examples/qwen2_5_vl_grpo.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHON": sys.executable, "DRY_RUN": "1",
                               "PLAN": "0", **env})


def dry_run(*args: str, **env: str) -> list[str]:
    """The `python -m vlmrl.train` arguments the script would run with."""
    done = launch(*args, **env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[:3] == [sys.executable, "-m", "vlmrl.train"], lines
    return lines[3:]


def value(args: list[str], key: str) -> str:
    found = [a.split("=", 1)[1] for a in args if a.startswith(key + "=")]
    assert found, f"{key} not set in {args}"
    return found[-1]


@pytest.mark.parametrize("model, output", [("tiny", "outputs/demo"), ("tiny-qwen3-vl", "outputs/demo-tiny-qwen3-vl"),
                                           ("tiny-qwen3.5", "outputs/demo-tiny-qwen3.5"),
                                           ("tiny-glm4v", "outputs/demo-tiny-glm4v"),
                                           ("tiny-internvl", "outputs/demo-tiny-internvl")])
def test_an_embedded_name_runs_the_demo_on_that_model(model, output):
    args = dry_run(MODEL_PATH=model, ROLLOUT="hf")
    assert value(args, "config") == "examples/configs/tiny_synthetic.yaml"
    assert value(args, "trainer.output_dir") == output
    config = load_config(args)  # checks the model's context too
    assert config.actor.model_path == model and config.data.train_files == "synthetic"
    from vlmrl.processors.loading import load_processor

    processor = load_processor(model, config.data)  # the demo's pixel bounds fit this model's processor
    assert processor.family.name == {"tiny-qwen3-vl": "Qwen3-VL", "tiny-qwen3.5": "Qwen3.5",
                                     "tiny-glm4v": "GLM-4.1V", "tiny-internvl": "InternVL3.5"}.get(model, "Qwen2.5-VL")


@pytest.mark.parametrize("model, recipe", [("Qwen/Qwen3-VL-8B-Instruct", "qwen3_vl_geo3k"),
                                           ("Qwen/Qwen3.5-9B", "qwen3_5_geo3k"),
                                           ("Qwen/Qwen3-VL-30B-A3B-Instruct", "qwen3_vl_moe_geo3k"),
                                           ("Qwen/Qwen3.5-35B-A3B", "qwen3_5_moe_geo3k"),
                                           ("zai-org/GLM-4.1V-9B-Thinking", "glm4_1v_geo3k"),
                                           ("OpenGVLab/InternVL3_5-8B-HF", "internvl3_5_geo3k"),
                                           ("Qwen/Qwen2.5-VL-7B-Instruct", "qwen2_5_vl_geo3k"),
                                           ("Qwen/Qwen2.5-VL-32B-Instruct", "qwen2_5_vl_32b_geo3k")])
def test_a_hub_id_picks_its_familys_recipe_by_name(model, recipe):
    """On the 8 devices the geo3k recipes are for (the MoE and 32B ones run their engines across devices)."""
    args = dry_run(MODEL_PATH=model, N_GPUS="8")
    assert value(args, "config") == f"examples/configs/{recipe}.yaml"
    assert value(args, "trainer.output_dir") == f"outputs/{recipe}"
    config = load_config(args, check_model=False)
    assert config.actor.model_path == model and config.data.train_files == "~/data/geo3k/train.parquet"
    # the data's place is a key like any other, passed through after the recipe
    moved = load_config(dry_run("data.train_files=/data/geo3k/train.parquet", MODEL_PATH=model, N_GPUS="8"),
                        check_model=False)
    assert moved.data.train_files == "/data/geo3k/train.parquet"


def test_a_dry_run_prints_the_memory_plan_of_a_geo3k_recipe_on_stderr():
    """The command alone on stdout (what the tests above read), the plan and its verdict on stderr; the CPU demo
    gets none (the plan sizes GPUs), nor does PLAN=0."""
    done = launch(MODEL_PATH="Qwen/Qwen2.5-VL-32B-Instruct", N_GPUS="8", PLAN="1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[:3] == [sys.executable, "-m", "vlmrl.train"]
    assert "memory plan: Qwen/Qwen2.5-VL-32B-Instruct" not in done.stdout
    plan = done.stderr.splitlines()
    assert any(line.startswith("memory plan: Qwen/Qwen2.5-VL-32B-Instruct (Qwen2.5-VL, 33.45B") for line in plan)
    assert plan[-1].startswith("verdict: fits 8 x 80.0 GiB at TP 8: peak ")
    assert "verdict:" not in launch(ROLLOUT="hf", PLAN="1").stderr


def test_a_local_folder_picks_the_recipe_of_its_config(tiny_model_path, tiny_qwen3_vl_path, tiny_qwen3_5_path,
                                                       tmp_path):
    """A folder's name says nothing: its config.json decides (every copy is named `policy`)."""
    for source, recipe in [(tiny_qwen3_vl_path, "qwen3_vl_geo3k"), (tiny_model_path, "qwen2_5_vl_geo3k"),
                           (tiny_qwen3_5_path, "qwen3_5_geo3k")]:
        folder = tmp_path / recipe / "policy"
        shutil.copytree(source, folder)
        args = dry_run(MODEL_PATH=str(folder))
        assert value(args, "config") == f"examples/configs/{recipe}.yaml"
        assert value(args, "actor.model_path") == str(folder)


def test_the_qwen3_vl_recipe_loads_and_fits_the_models_image_bounds():
    config = load_config([f"config={ROOT / 'examples' / 'configs' / 'qwen3_vl_geo3k.yaml'}"], check_model=False)
    # the released Qwen3-VL processors allow 65536..16777216 pixels: null = the model's minimum
    assert config.data.min_pixels is None and 65536 <= config.data.max_pixels <= 16777216
    assert config.data.max_pixels % (32 * 32) == 0
    assert (config.actor.optim.lr, config.rollout.n, config.actor.kl_loss_coef) == (1e-6, 5, 0.01)


def test_the_glm4_1v_recipe_loads_with_verls_settings_and_fits_the_released_bounds(tmp_path):
    """verl's run_glm41v_9b.sh settings; the pixel bounds fit GLM-4.1V-9B's image processor (12544..9633792 over
    an image's two temporal copies: 6272..4816896 per image) on 28-pixel sides; a local GLM-4.1V folder picks it."""
    from vlmrl.models.tiny import ensure_built

    config = load_config([f"config={ROOT / 'examples' / 'configs' / 'glm4_1v_geo3k.yaml'}"], check_model=False)
    assert config.data.min_pixels is None and 6272 <= config.data.max_pixels <= 4816896
    assert config.data.max_pixels % (28 * 28) == 0
    assert (config.data.train_batch_size, config.actor.ppo_mini_batch_size, config.rollout.n) == (32, 32, 5)
    assert (config.actor.optim.lr, config.actor.kl_loss_coef, config.actor.kl_loss_type) == (1e-6, 0.01,
                                                                                             "low_var_kl")
    folder = tmp_path / "glm" / "policy"
    shutil.copytree(ensure_built("tiny-glm4v"), folder)
    assert value(dry_run(MODEL_PATH=str(folder)), "config") == "examples/configs/glm4_1v_geo3k.yaml"


def test_the_internvl3_5_recipe_loads_with_opengvlabs_settings_and_a_local_folder_picks_it(tmp_path):
    """OpenGVLab's InternVL3.5-8B online-RL settings (verl-internvl); no pixel bounds (tiles); prompts long enough
    for geo3k's 7 to 13 tiles of 256 tokens; a local InternVL folder picks it by its config.json."""
    from vlmrl.models.tiny import ensure_built

    config = load_config([f"config={ROOT / 'examples' / 'configs' / 'internvl3_5_geo3k.yaml'}"], check_model=False)
    assert config.data.min_pixels is None and config.data.max_pixels is None
    assert config.data.max_prompt_length >= 13 * 256 + 2 + 64
    assert (config.data.train_batch_size, config.actor.ppo_mini_batch_size, config.rollout.n) == (512, 32, 16)
    assert (config.actor.optim.lr, config.actor.use_kl_loss, config.actor.micro_batch_tokens) == (1e-6, False, 16384)
    folder = tmp_path / "internvl" / "policy"
    shutil.copytree(ensure_built("tiny-internvl"), folder)
    assert value(dry_run(MODEL_PATH=str(folder)), "config") == "examples/configs/internvl3_5_geo3k.yaml"


def test_the_qwen3_5_recipe_loads_with_slimes_geo3k_settings():
    config = load_config([f"config={ROOT / 'examples' / 'configs' / 'qwen3_5_geo3k.yaml'}"], check_model=False)
    assert config.data.min_pixels is None and config.data.max_pixels % (32 * 32) == 0
    assert (config.actor.optim.lr, config.actor.optim.weight_decay, config.actor.optim.betas) == (1e-6, 0.1,
                                                                                                 [0.9, 0.98])
    assert (config.rollout.n, config.rollout.temperature, config.data.max_response_length) == (8, 0.8, 4096)
    assert config.data.train_batch_size * config.rollout.n == 512 and not config.actor.use_kl_loss
    assert (config.actor.clip_ratio, config.actor.clip_ratio_high) == (0.2, 0.28)
    assert not config.actor.padding_free


def test_the_moe_recipes_load_with_their_anchors_settings(tmp_path):
    """EasyR1's Qwen3-VL-30B-A3B geo3k run and the Qwen3.5 geo3k settings on the 35B-A3B; a local MoE folder picks
    its family's recipe by its config.json; routing replay R2 (the trainer's own routing, recorded on every rank)."""
    from vlmrl.models.tiny import ensure_built

    eight = "trainer.n_gpus_per_node=8"  # their engines span 2 devices (rollout.tensor_parallel_size=2)
    vl = load_config([f"config={ROOT / 'examples' / 'configs' / 'qwen3_vl_moe_geo3k.yaml'}", eight], check_model=False)
    assert (vl.actor.optim.lr, vl.rollout.n, vl.actor.kl_loss_coef, vl.actor.dtype) == (1e-6, 5, 0.01, "bfloat16")
    assert (vl.data.train_batch_size, vl.actor.ppo_mini_batch_size) == (512, 128)
    q35 = load_config([f"config={ROOT / 'examples' / 'configs' / 'qwen3_5_moe_geo3k.yaml'}", eight],
                      check_model=False)
    assert (q35.rollout.n, q35.rollout.temperature, q35.actor.optim.weight_decay) == (8, 0.8, 0.1)
    for config in (vl, q35):
        assert config.actor.moe.routing_replay == "trainer" and config.data.max_pixels % (32 * 32) == 0
    for variant, recipe in [("tiny-qwen3-vl-moe", "qwen3_vl_moe_geo3k"), ("tiny-qwen3.5-moe", "qwen3_5_moe_geo3k")]:
        folder = tmp_path / recipe / "policy"
        shutil.copytree(ensure_built(variant), folder)
        assert value(dry_run(MODEL_PATH=str(folder)), "config") == f"examples/configs/{recipe}.yaml"


def test_the_distill_recipe_loads_with_verls_vlm_example_settings():
    """RECIPE=distill on 8 devices: the GRPO recipe, then the distillation overlay (Qwen2.5-VL-7B teaching the 3B,
    which MODEL_PATH defaults to), with the settings of verl's run_qwen3_vl_geo3k.sh the overlay cites: the negative
    k1 as a per-token advantage (use_policy_gradient), no task reward, 128 prompts and one update a step, lr 1e-6,
    no KL loss, prompts 1024 and responses 2048 tokens. Loaded without the hub (check_model=False: the teacher's
    tokenizer is compared once it is downloaded)."""
    args = dry_run(RECIPE="distill", N_GPUS="8")
    configs = [a.split("=", 1)[1] for a in args if a.startswith("config=")]
    assert configs == ["examples/configs/qwen2_5_vl_geo3k.yaml", "examples/configs/qwen2_5_vl_geo3k_distill.yaml"]
    config = load_config(args, check_model=False)
    assert config.trainer.output_dir == "outputs/qwen2_5_vl_geo3k_distill" and config.trainer.n_gpus_per_node == 8
    distill = config.algorithm.distill
    assert (config.actor.model_path, distill.teacher) == ("Qwen/Qwen2.5-VL-3B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct")
    assert (distill.mode, distill.estimator, distill.discount, distill.reward_weight) == ("advantage", "k1", 0.0, 0.0)
    assert (distill.loss_max_clamp, distill.log_prob_min_clamp) == (10.0, None)  # verl's; its other clamp is top-k's
    assert (distill.teacher_engine, distill.teacher_dtype) == ("trainer", "bfloat16")
    assert (config.data.train_batch_size, config.actor.ppo_mini_batch_size, config.actor.optim.lr) == (128, 128, 1e-6)
    assert (config.data.max_prompt_length, config.data.max_response_length) == (1024, 2048)
    assert not config.actor.use_kl_loss and config.rollout.temperature == 1.0
    # the overlay alone on the GRPO recipe, as its comment runs it, is the same run
    direct = load_config(["config=" + str(ROOT / "examples" / "configs" / name) for name in
                          ("qwen2_5_vl_geo3k.yaml", "qwen2_5_vl_geo3k_distill.yaml")], check_model=False)
    assert direct.algorithm == config.algorithm and direct.actor.model_path == config.actor.model_path


def test_the_distill_recipe_on_the_demo_distils_the_trained_demo(tiny_model_path):
    """On the demo RECIPE=distill takes tiny_synthetic_distill.yaml after the demo's config: the trained demo
    (outputs/demo/checkpoints/latest) teaches a fresh tiny model; missing, the launcher says to run the demo first,
    unless a teacher is given."""
    given = dry_run(f"algorithm.distill.teacher={tiny_model_path}", RECIPE="distill", ROLLOUT="hf")
    config = load_config(given)  # the teacher checked against the student (both local: no hub)
    assert [a for a in given if a.startswith("config=")] == ["config=examples/configs/tiny_synthetic_distill.yaml",
                                                             "config=examples/configs/tiny_synthetic.yaml"]
    assert config.trainer.output_dir == "outputs/demo_distill" and config.actor.model_path == "tiny"
    assert config.algorithm.distill.teacher == tiny_model_path and config.data.train_files == "synthetic"
    if (ROOT / "outputs" / "demo" / "checkpoints" / "latest").exists():  # a checkout where the demo ran
        config = load_config(dry_run(RECIPE="distill", ROLLOUT="hf"), check_model=False)
        assert config.algorithm.distill.teacher == "outputs/demo/checkpoints/latest"
    else:
        done = launch(RECIPE="distill", ROLLOUT="hf")
        assert done.returncode == 2 and "run the demo first" in done.stderr, done.stderr


def test_recipe_overlays_stack_on_the_demo_and_on_the_geo3k_recipe():
    """RECIPE=dapo+lora: the algorithm's overlay, then LoRA's; on the demo the demo's own settings win over the
    overlay's (its batch, lengths, lr) and LoRA there adapts lm_head too (the random-init model needs it)."""
    demo = load_config(dry_run(RECIPE="dapo+lora", ROLLOUT="hf"))
    assert demo.trainer.output_dir == "outputs/demo_lora_dapo"
    assert (demo.data.train_batch_size, demo.actor.clip_ratio_high, demo.algorithm.overlong_buffer_len) == (16, 0.28, 1)
    assert (demo.actor.lora.rank, demo.actor.lora.alpha, demo.actor.lora.vision) == (16, 16, "off")
    assert "lm_head" in demo.actor.lora.target_modules and demo.actor.optim.lr == 1e-3
    real = load_config(dry_run(RECIPE="dapo+lora", MODEL_PATH="Qwen/Qwen2.5-VL-7B-Instruct", N_GPUS="8"),
                       check_model=False)
    assert real.trainer.output_dir == "outputs/qwen2_5_vl_geo3k_lora_dapo" and real.trainer.n_gpus_per_node == 8
    assert (real.actor.lora.rank, real.actor.optim.lr, real.actor.clip_ratio_high) == (64, 1e-5, 0.28)
    assert "lm_head" not in real.actor.lora.target_modules and real.data.max_response_length == 2048
    # what the LoRA switches of earlier versions set is plain keys now, after the recipe
    tuned = load_config(dry_run("actor.lora.rank=8", "actor.lora.vision=tower+merger", RECIPE="lora", ROLLOUT="hf"))
    assert (tuned.actor.lora.rank, tuned.actor.lora.vision, tuned.trainer.output_dir) == (8, "tower+merger",
                                                                                          "outputs/demo_lora")


def test_validate_only_writes_beside_the_run_and_keeps_a_demo_checkpoints_recipe(tmp_path):
    """A checkpoint the demo wrote is validated on the demo's config (tour step 2), into outputs/demo-val; a LoRA
    recipe is ignored there (the weights are validated as they are)."""
    checkpoint = tmp_path / "checkpoints" / "global_step_150"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text('{"config": {"data": {"train_files": "synthetic"}}}')
    args = dry_run(VAL_ONLY="1", RECIPE="lora", MODEL_PATH=str(checkpoint))
    config = load_config(args, check_model=False)
    assert value(args, "config") == "examples/configs/tiny_synthetic.yaml"
    assert config.trainer.val_only and config.trainer.output_dir == "outputs/demo-val"
    assert config.actor.model_path == str(checkpoint) and config.actor.lora.rank == 0


def test_the_demo_falls_back_to_hf_without_vllm(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None\n")  # vllm not importable
    done = launch(PYTHONPATH=f"{tmp_path}:{ROOT}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rollout.name=hf" in done.stdout.splitlines() and "vLLM is not installed" in done.stderr
    if importlib.util.find_spec("vllm"):  # where it is installed, the demo's engine
        assert "rollout.name=vllm" in dry_run()


@pytest.mark.parametrize("switch, setting", [("LORA_RANK", "16"), ("DATA", "geo3k"), ("DATA_DIR", "/data/geo3k")])
def test_an_earlier_versions_switch_is_refused_naming_the_key_that_replaced_it(switch, setting):
    done = launch(**{switch: setting})
    assert done.returncode == 2 and f"{switch} is no longer read" in done.stderr
    assert "RECIPE=lora" in done.stderr and "data.train_files=" in done.stderr
