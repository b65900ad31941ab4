"""The memory plan's arithmetic against sizes computed by hand, its command line (exit status, one error line, JSON),
and every geo3k recipe at 8 devices x 80 GiB: it fits at its own rollout.tensor_parallel_size and its comment says
the plan's figure. (Against measured peaks: test_memory_measured.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vlmrl.config import Config, load_config
from vlmrl.plan import main
from vlmrl.trainer.memory_activations import MicroBatch, Precision, activation_bytes, text_layer_bytes
from vlmrl.trainer.memory_model import ROOT_UNIT, ModelFacts, TensorFact, TextShape, model_facts
from vlmrl.trainer.memory_plan import (
    GIB,
    RUNTIME_GIB,
    engine_weights,
    head_problem,
    kv_per_token,
    memory_plan,
    tp_candidates,
)

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
LAYER = "model.language_model.layers.0"
TEXT = TextShape(hidden=4, layers=1, attention_layers=1, moe_layers=0, heads=2, kv_heads=1, head_dim=2,
                 intermediate=8, vocab=10)


def hand_facts() -> ModelFacts:
    """A one-layer model written out by hand: embeddings (10 x 4) and lm_head in the root unit, one decoder layer
    (q 4x4, k 2x4, v 2x4, o 4x4, gate/up 8x4, down 4x8): 40 + 40 + 16 + 8 + 8 + 16 + 32 + 32 + 32 = 224 parameters."""
    tensors = [TensorFact("model.language_model.embed_tokens.weight", (10, 4), ROOT_UNIT, True),
               TensorFact("lm_head.weight", (10, 4), ROOT_UNIT, True)]
    for name, shape, kv in [("self_attn.q_proj", (4, 4), False), ("self_attn.k_proj", (2, 4), True),
                            ("self_attn.v_proj", (2, 4), True), ("self_attn.o_proj", (4, 4), False),
                            ("mlp.gate_proj", (8, 4), False), ("mlp.up_proj", (8, 4), False),
                            ("mlp.down_proj", (4, 8), False)]:
        tensors.append(TensorFact(f"{LAYER}.{name}.weight", shape, LAYER, True, kv=kv))
    return ModelFacts(model="hand", family="Qwen2.5-VL", source="by hand", tensors=tuple(tensors), text=TEXT,
                      vision=None, config={"model_type": "qwen2_5_vl",
                                                 "text_config": {"num_attention_heads": 2, "num_key_value_heads": 1}})


def hand_config(**trainer) -> Config:
    config = Config()
    config.actor.model_path = "hand"
    config.data.max_prompt_length, config.data.max_response_length = 6, 4
    config.actor.ppo_micro_batch_size_per_gpu = 2
    for key, value in trainer.items():
        setattr(config.trainer, key, value)
    return config


def test_a_sharded_tensor_keeps_ceil_of_its_rows_on_the_first_rank():
    """FSDP2 splits dim 0 in dp chunks padded to ceil(rows / dp): 10 rows over 4 ranks keep 3 rows each."""
    fact = TensorFact("w", (10, 3), ROOT_UNIT, True)
    assert [fact.shard_numel(dp) for dp in (1, 2, 4, 16)] == [30, 15, 9, 3]
    assert TensorFact("s", (), ROOT_UNIT, True).shard_numel(8) == 1


def test_a_layers_saved_tensors_by_hand():
    """H 4, 2 heads of 2 (q 4), 1 KV head (kv 2), MLP 8. float32 without autocast: two norms (float32 copy + output,
    32 + 32 bytes each... 4 x 4 + 4 x 4 = 32), the residual 16, attention q, k, v, out 2 x 4 + 2 x 2 = 12 elements
    (48 bytes; a mask expands k and v to 4: 64), the MLP 4 x 8 = 32 elements (128 bytes)."""
    fp32 = Precision(stream=4, compute=4)
    assert text_layer_bytes(TEXT, fp32, attention=True, moe=False, expand_kv=False) == 2 * 32 + 16 + 48 + 128
    assert text_layer_bytes(TEXT, fp32, attention=True, moe=False, expand_kv=True) == 2 * 32 + 16 + 64 + 128
    # autocast (float32 stream, bfloat16 compute): each norm keeps its float32 copy only (16), the residual 16, the
    # five bfloat16 input casts 5 x 4 x 2 = 40, attention 12 x 2 = 24, the MLP 32 x 2 = 64
    mixed = Precision(stream=4, compute=2)
    assert text_layer_bytes(TEXT, mixed, attention=True, moe=False, expand_kv=False) == 2 * 16 + 16 + 40 + 24 + 64


def test_activation_bounds_by_hand():
    """Checkpointed, one micro-batch of 2 rows x 8 tokens (16 tokens), no mask, no images, head chunk of 4 tokens:
    kept = 1 layer x 16 tokens x 4 x 4 bytes = 256; a layer's working set 16 x 256 = 4096 (once in the lower bound,
    twice in the upper); the final norm 3 x 16 x 4 x 4 = 768 and the rotary 2 x 16 x 2 x 4 = 256; the head
    4 x 4 tokens x 10 x 4 = 640 (upper only)."""
    mb = MicroBatch(rows=2, length=8, response_tokens=6, image_tokens=0, masked=False)
    fp32 = Precision(stream=4, compute=4)
    working = text_layer_bytes(TEXT, fp32, True, False, expand_kv=False) * 16
    assert working == 4096
    acts = activation_bytes(TEXT, None, mb, fp32, checkpointing=True, chunk=4, trainable_forward=224,
                            block_trainable=120, vision_trains=False)
    assert (acts.lower, acts.upper) == (256 + 4096 + 768 + 256, 256 + 2 * 4096 + 768 + 256 + 640)
    # under autocast the forward keeps a bfloat16 copy of every trainable weight: 2 x 224 bytes, under the working set
    mixed = activation_bytes(TEXT, None, mb, Precision(4, 2), True, 4, 224, 120, False)
    assert mixed.parts["of which autocast weight copies"] == 448


def test_resident_state_engine_and_kv_by_hand():
    """dp 2 of the hand model in float32: each rank's shard is ceil(rows / 2) of every tensor (5 + 5 rows of 4 for the
    embeddings and head, 2 + 1 + 1 + 2 + 4 + 4 + 2 rows of 4 or 8 for the layer) = 20 + 20 + 8 + 4 + 4 + 8 + 16 + 16
    + 16 = 112 elements: 448 bytes of parameters, 448 of gradients, 896 of AdamW moments."""
    config = hand_config(n_gpus_per_node=2)
    plan = memory_plan(config, hand_facts(), device_gib=1, gpu=False)
    rollout = plan.phases[0].items
    assert (rollout["policy parameters"], rollout["gradients"], rollout["optimizer moments"]) == (448, 448, 896)
    # actor.offload.optimizer: the moments wait in host memory, and come to the device for the step only
    config.actor.offload.optimizer = True
    offloaded = memory_plan(config, hand_facts(), device_gib=1, gpu=False)
    assert offloaded.phases[0].items["optimizer moments"] == 0 and offloaded.host["optimizer moments"] == 896
    assert offloaded.phases[-1].items["optimizer moments"] == 896
    # the engine in bfloat16 at TP 2: (224 - 16 KV parameters) / 2 + 16 x max(1/2, 1/1 KV head) = 120 elements
    facts = hand_facts()
    assert engine_weights(facts, 1, 2) == 448 and engine_weights(facts, 2, 2) == 240
    # a token's KV: 2 (k, v) x 1 layer x 1 head x 2 dims x 2 bytes; at TP 2 a rank still keeps the whole head
    assert kv_per_token(facts, 1, 2) == kv_per_token(facts, 2, 2) == 8


def test_tensor_parallel_candidates_divide_the_devices_and_the_heads():
    """The run's own rule (vlmrl.config.tensor_parallel_problems), on the model's config.json."""
    facts = hand_facts()
    assert tp_candidates(8) == [1, 2, 4, 8]
    assert head_problem(2, facts) == ""  # 2 heads split; 1 KV head is replicated
    assert head_problem(4, facts).startswith("rollout.tensor_parallel_size=4 does not split the language model's 2 "
                                             "attention heads")


def test_the_gpu_plan_adds_the_runtime_and_releases_the_engine_while_training():
    """On GPUs a colocated vLLM sleeps from the first training call: its share of the device is in the rollout phase
    only, and every phase carries the runtime reserve."""
    config = hand_config(n_gpus_per_node=2)
    plan = memory_plan(config, hand_facts(), device_gib=1)
    phases = {phase.name: phase.items for phase in plan.phases}
    assert phases["rollout"]["engine (awake)"] == int(0.6 * GIB)
    assert "engine (awake)" not in phases["update"]
    assert all(items["runtime (CUDA contexts, NCCL)"] == RUNTIME_GIB * GIB for items in phases.values())


def test_the_distillation_teacher_is_counted_like_the_reference_in_its_own_dtype():
    """A teacher in the trainer (the hand model again, float32): at dp 2 each rank keeps its 112-element shard (448
    bytes) through every phase, or (actor.offload.reference) in host memory; on one GPU, offloaded, it visits whole
    in bfloat16 (224 x 2 bytes) for its pass, on top of its no-grad forward; on a CPU it stays (nothing to offload
    to)."""
    config = hand_config(n_gpus_per_node=2)
    config.algorithm.distill.teacher, config.algorithm.distill.teacher_dtype = "hand", "float32"
    config.actor.offload.reference = False
    plan = memory_plan(config, hand_facts(), device_gib=1, gpu=False, teacher=hand_facts())
    assert all(phase.items["teacher"] == 448 for phase in plan.phases) and "teacher" not in plan.host
    config.actor.offload.reference = True
    offloaded = memory_plan(config, hand_facts(), device_gib=1, gpu=False, teacher=hand_facts())
    assert "teacher" not in offloaded.phases[0].items and offloaded.host["teacher"] == 448
    one = hand_config()
    one.algorithm.distill.teacher = "hand"  # teacher_dtype auto: bfloat16 on a GPU, float32 on a CPU
    on_cpu = memory_plan(one, hand_facts(), device_gib=1, gpu=False, teacher=hand_facts())
    assert on_cpu.phases[0].items["teacher"] == 896 and "teacher" not in on_cpu.host
    on_gpu = memory_plan(one, hand_facts(), device_gib=1, teacher=hand_facts())
    assert "teacher" not in on_gpu.phases[0].items and on_gpu.host["teacher"] == 448
    from vlmrl.trainer.memory_activations import forward_bytes
    from vlmrl.trainer.memory_plan import micro_batch

    policy_pass = {p.name: p.items for p in memory_plan(hand_config(), hand_facts(), device_gib=1).phases}[
        "logprobs"]["forward (no grad)"]
    teacher_pass = 448 + forward_bytes(TEXT, None, micro_batch(one, hand_facts()), Precision(stream=2, compute=2),
                                       one.actor.logprob_chunk_size)
    assert {p.name: p.items for p in on_gpu.phases}["logprobs"]["forward (no grad)"] == max(policy_pass, teacher_pass)


def test_an_engine_teacher_takes_its_share_while_scoring_and_the_check_loads_it_once():
    """teacher_engine=vllm on a GPU: teacher_gpu_memory_utilization of the device in the logprobs phase only (it
    sleeps otherwise, its bfloat16 weights in host memory), and the first step's check (the teacher in the trainer
    once) in the same phase; engine_check_samples=0 leaves the check out."""
    config = hand_config()
    d = config.algorithm.distill
    d.teacher, d.teacher_engine, d.teacher_gpu_memory_utilization = "hand", "vllm", 0.25
    plan = memory_plan(config, hand_facts(), device_gib=1, teacher=hand_facts())
    phases = {phase.name: phase.items for phase in plan.phases}
    assert phases["logprobs"]["teacher engine (awake)"] == int(0.25 * GIB)
    assert all("teacher engine (awake)" not in phases[name] for name in ("rollout", "update", "optimizer step"))
    assert plan.host["teacher engine weights (asleep)"] == 448 and "teacher" not in phases["rollout"]
    # one pass at a time: the policy's, or the check's (the teacher's 448 bytes of bfloat16 weights and its forward)
    from vlmrl.trainer.memory_activations import forward_bytes
    from vlmrl.trainer.memory_plan import micro_batch

    policy_pass = {p.name: p.items for p in memory_plan(hand_config(), hand_facts(), device_gib=1).phases}[
        "logprobs"]["forward (no grad)"]
    check = 448 + forward_bytes(TEXT, None, micro_batch(config, hand_facts()), Precision(stream=2, compute=2),
                                config.actor.logprob_chunk_size)
    assert phases["logprobs"]["forward (no grad)"] == max(policy_pass, check)
    d.engine_check_samples = 0
    unchecked = memory_plan(config, hand_facts(), device_gib=1, teacher=hand_facts())
    assert {p.name: p.items for p in unchecked.phases}["logprobs"]["forward (no grad)"] == policy_pass



def test_a_teacher_served_by_url_takes_no_device_memory_here_but_its_check_in_the_driver():
    """teacher_engine=sglang-server at a URL: the server's devices are its own, so no engine share on these; the
    first step's check loads the teacher once, on the device at dp 1 (as for an engine teacher), in the driver's
    host memory at dp > 1; engine_check_samples=0 leaves nothing."""
    config = hand_config()
    d = config.algorithm.distill
    d.teacher, d.teacher_engine, d.teacher_url = "hand", "sglang-server", "http://10.0.0.7:30000"
    plan = memory_plan(config, hand_facts(), device_gib=1, teacher=hand_facts())
    assert not any(key.startswith("teacher engine") for phase in plan.phases for key in phase.items)
    assert not any(key.startswith("teacher") for key in plan.host)
    policy_pass = {p.name: p.items for p in memory_plan(hand_config(), hand_facts(), device_gib=1).phases}[
        "logprobs"]["forward (no grad)"]
    from vlmrl.trainer.memory_activations import forward_bytes
    from vlmrl.trainer.memory_plan import micro_batch

    check = 448 + forward_bytes(TEXT, None, micro_batch(config, hand_facts()), Precision(stream=2, compute=2),
                                config.actor.logprob_chunk_size)
    assert {p.name: p.items for p in plan.phases}["logprobs"]["forward (no grad)"] == max(policy_pass, check)
    sharded = hand_config(n_gpus_per_node=2)
    sharded.algorithm.distill = d
    two = memory_plan(sharded, hand_facts(), device_gib=1, teacher=hand_facts())
    assert two.host["teacher (first-step check, in the driver)"] == check
    assert not any(key.startswith("teacher") for phase in two.phases for key in phase.items)
    d.engine_check_samples = 0
    unchecked = memory_plan(sharded, hand_facts(), device_gib=1, teacher=hand_facts())
    assert not any(key.startswith("teacher") for key in unchecked.host)


# ---- the command line -----------------------------------------------------------------------------------------------

RECIPE_7B = [f"config={CONFIGS / 'qwen2_5_vl_geo3k.yaml'}", "trainer.n_gpus_per_node=8"]


def test_the_plan_prints_a_table_and_a_verdict_and_exits_0_when_it_fits(capsys):
    assert main(RECIPE_7B) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("verdict: fits 8 x 80.0 GiB at TP 1: peak ")
    assert any(line.split()[:2] == ["policy", "parameters"] for line in out)


def test_the_plan_of_a_distillation_run_has_a_teacher_row(tmp_path, capsys):
    """tiny-large teaching tiny, in the trainer on one GPU (offloaded with the reference): its weights wait in host
    memory and visit for their pass; the plan reads the teacher's own shapes."""
    assert main(["actor.model_path=tiny", "data.train_files=synthetic", "data.val_files=synthetic",
                 "algorithm.distill.teacher=tiny-large",
                 f"trainer.output_dir={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert "host memory per device:" in out and "teacher " in out.split("host memory per device:")[1], out


def test_a_device_too_small_exits_1_naming_the_phase(capsys):
    assert main([*RECIPE_7B, "--device-gb", "40"]) == 1
    verdict = capsys.readouterr().out.splitlines()[-1]
    assert verdict.startswith("verdict: does not fit 8 x 40.0 GiB at TP 1: the ") and "phase needs" in verdict


def test_json_for_machines(capsys):
    assert main([*RECIPE_7B, "--json", "--device-gb=80"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["devices"] == 8 and plan["tp"] == 1 and plan["smallest_tp"] == 1
    assert plan["parameters"] == 8_292_166_656  # Qwen2.5-VL-7B-Instruct, as its model card counts it (8.29B)
    assert set(plan["phases"]) == {"rollout", "weight sync", "logprobs", "update", "optimizer step"}
    assert "does not split the language model's 28 attention heads" in plan["tp_options"]["8"]["why_not"]


@pytest.mark.parametrize("args, message", [
    (["actor.no_such_key=1"], "unknown config key 'actor.no_such_key'"),
    (["rollout.tensor_parallel_size=3"], "rollout.tensor_parallel_size=3 must divide the 8 devices"),
    (["rollout.tensor_parallel_size=8"], "does not split the language model's 28 attention heads"),
    (["actor.model_path=org/not-a-released-model"], "'org/not-a-released-model': not downloaded"),
    (["--device-gb", "lots"], "--device-gb 'lots' is not a number"),
])
def test_a_bad_config_is_one_error_line_and_exit_2(args, message, capsys):
    assert main([*RECIPE_7B, *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_python_dash_m_runs_it():
    done = subprocess.run([sys.executable, "-m", "vlmrl.plan", *RECIPE_7B, "--device-gb", "20"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout.splitlines()[-1].startswith("verdict: does not fit"), done.stderr


# ---- the recipes ----------------------------------------------------------------------------------------------------

BASE_RECIPES = sorted(p.name for p in CONFIGS.glob("*_geo3k*.yaml")
                      if not re.search(r"_geo3k_(dapo|gspo|lora|distill)", p.name))
OVERLAYS = sorted(p.name for p in CONFIGS.glob("qwen2_5_vl_geo3k_*.yaml"))
FIGURE = re.compile(r"# Memory \(python -m vlmrl\.plan, 8 x 80 GiB\): peak (\d+\.\d) GiB per device \(([a-z ]+)\) at "
                    r"TP (\d)")


@pytest.mark.parametrize("files", [[name] for name in BASE_RECIPES] + [["qwen2_5_vl_geo3k.yaml", o] for o in OVERLAYS],
                         ids=lambda files: "+".join(files))
def test_every_recipe_fits_8_devices_of_80_gib_at_its_tp_and_says_its_figure(files):
    """Each recipe at 8 devices x 80 GiB (the launcher's N_GPUS=8): it fits at its own tensor parallel degree, and
    the comment that states its per-device figure is the plan's (the overlay's comment: on the 7B recipe)."""
    config = load_config([f"config={CONFIGS / name}" for name in files] + ["trainer.n_gpus_per_node=8"])
    tp = config.rollout.tensor_parallel_size
    plan = memory_plan(config, model_facts(config.actor), device_gib=80)
    assert plan.fits, f"{files}: {plan.problems}"
    stated = FIGURE.findall((CONFIGS / files[-1]).read_text())
    assert len(stated) == 1, f"{files[-1]} states no (or more than one) memory figure"
    peak, phase, stated_tp = stated[0]
    assert (float(peak), phase, int(stated_tp)) == (round(plan.peak.total / GIB, 1), plan.peak.name, tp), files


def test_the_32b_recipe_follows_easyr1s_baseline():
    """EasyR1's examples/qwen2_5_vl_32b_geo3k_grpo.sh on its examples/config.yaml: bfloat16 actor and AdamW, vLLM at
    TP 8 with 0.6 of the device, 2048 + 2048 tokens, global batch 128 of 512 prompts x 5."""
    config = load_config([f"config={CONFIGS / 'qwen2_5_vl_32b_geo3k.yaml'}", "trainer.n_gpus_per_node=8"])
    assert config.actor.model_path == "Qwen/Qwen2.5-VL-32B-Instruct"
    assert (config.rollout.tensor_parallel_size, config.rollout.gpu_memory_utilization) == (8, 0.6)
    assert config.actor.dtype == "bfloat16" and config.actor.offload.optimizer
    assert (config.data.max_prompt_length, config.data.max_response_length) == (2048, 2048)
    assert (config.data.train_batch_size, config.actor.ppo_mini_batch_size, config.rollout.n) == (512, 128, 5)
    assert (config.actor.optim.lr, config.actor.kl_loss_coef) == (1e-6, 0.01)
