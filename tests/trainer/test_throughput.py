"""Throughput metrics: the model-FLOPs formula on known configs (Qwen2.5-VL-3B by hand; the tiny models against
their own modules, counted; the vision attention spans against transformers'), EasyR1's flops counter written out,
the device peak table, and the step metrics. Every family's rule against torch's FlopCounterMode is in the family
matrix (tests/families/test_family_matrix.py)."""

from __future__ import annotations

import random

import pytest
import torch

from vlmrl.models.flops import ModelFlops, model_flops
from vlmrl.trainer.throughput import batch_shapes, device_peak_flops, step_throughput

# Qwen/Qwen2.5-VL-3B-Instruct's architecture fields (benchmarks/gpu_check.py builds the same model)
QWEN25_VL_3B = {
    "model_type": "qwen2_5_vl",
    "text_config": {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
                    "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 151936},
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 2048, "fullatt_block_indexes": [7, 15, 23, 31], "window_size": 112,
                      "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
}


def test_qwen2_5_vl_3b_by_hand():
    f = model_flops(QWEN25_VL_3B)
    # language model, per layer: SwiGLU 3 x 2048 x 11008 = 67,633,152; q, k, v, o 2048 x (2048 + 256 + 256 + 2048)
    # = 9,437,184 (head_dim 128, 2 kv heads); x 36 layers = 2,774,532,096; embedding + LM head 2 x 151936 x 2048 =
    # 622,329,856 -> 3,396,861,952 matmul parameters a token: 20.4 GFLOPs of forward + backward
    assert f.text_params == 3_396_861_952
    assert f.text_attention == 128 * 16 * 36
    # vision tower, per patch: patch embedding 3 x 2 x 14 x 14 x 1280 = 1,505,280; a block 4 x 1280^2 + 3 x 1280 x
    # 3420 = 19,686,400, x 32 = 629,964,800; merger (5120^2 + 5120 x 2048) / 4 = 9,175,040 -> 640,645,120
    assert f.vision_params == 640_645_120
    assert (f.vision_width, f.vision_full_layers, f.vision_window_layers, f.window, f.merge_size) == (1280, 4, 28, 4, 2)
    # one row of 1024 tokens holding one 28 x 28-patch image (784 patches, 196 of the tokens). Its windows: the 14 x 14
    # merged grid in 4 x 4 windows from the corner, sides 4, 4, 4, 2 -> sum of squared window sizes (16 + 16 + 16 +
    # 4)^2 x 2^4 = 43,264 patches^2; full attention over the frame 784^2
    text = 6 * 3_396_861_952 * 1024 + 12 * 73_728 * 1024 ** 2
    # (the patch embedding's backward makes no gradient for the pixels: 4 x its parameters, not 6 x)
    vision = 6 * 640_645_120 * 784 - 2 * 1_505_280 * 784 + 12 * 1280 * (4 * 784 ** 2 + 28 * 43_264)
    assert f.update_flops([1024], [[1, 28, 28]]) == pytest.approx(text + vision, rel=1e-12)
    forward = 2 * 640_645_120 * 784 + 4 * 1280 * (4 * 784 ** 2 + 28 * 43_264)
    assert f.vision_flops([[1, 28, 28]], trains=False) == pytest.approx(forward, rel=1e-12)


def test_qwen3_5_9b_by_hand():
    """The released Qwen3.5-9B config (vlmrl ships it): 32 layers, every 4th gated softmax attention, the others
    Gated DeltaNet; only the softmax layers count s^2."""
    import json

    from vlmrl.models.released import RELEASED_CONFIGS

    f = model_flops(json.loads((RELEASED_CONFIGS / "Qwen--Qwen3.5-9B.json").read_text()))
    # 8 softmax layers: q (with its output gate) 4096 x 2 x 16 x 256, k and v 4096 x 4 x 256 each, o 16 x 256 x 4096
    # = 58,720,256; 24 Gated DeltaNet layers: in_proj_qkv 4096 x (2 x 16 x 128 + 32 x 128), in_proj_z 4096 x 32 x
    # 128, in_proj_b and in_proj_a 4096 x 32, out_proj 32 x 128 x 4096 = 67,371,008; 32 SwiGLU MLPs 3 x 4096 x
    # 12288 = 150,994,944; embedding + LM head 2 x 248320 x 4096
    assert f.text_params == 8 * 58_720_256 + 24 * 67_371_008 + 32 * 150_994_944 + 2 * 248_320 * 4096
    assert f.text_attention == 256 * 16 * 8
    linear = f.linear
    assert (linear.layers, linear.heads, linear.key_dim, linear.value_dim, linear.conv_channels, linear.conv_kernel) \
        == (24, 32, 128, 128, 8192, 4)


def easyr1_llama_flops(config: dict, tokens_sum: int, batch_seqlens: list[int], delta_time: float) -> float:
    """hiyouga/EasyR1 verl/utils/flops_counter.py FlopsCounter._estimate_llama_flops (EasyR1 b44b311; used for
    qwen2_vl, qwen2_5_vl and qwen3_vl, on config.text_config), written out: achieved TFLOP/s."""
    hidden_size = config["hidden_size"]
    vocab_size = config["vocab_size"]
    num_hidden_layers = config["num_hidden_layers"]
    num_key_value_heads = config["num_key_value_heads"]
    num_attention_heads = config["num_attention_heads"]
    intermediate_size = config["intermediate_size"]
    head_dim = config.get("head_dim", hidden_size // num_attention_heads)
    q_size = num_attention_heads * head_dim
    k_size = num_key_value_heads * head_dim
    v_size = num_key_value_heads * head_dim
    mlp_n = hidden_size * intermediate_size * 3
    attn_linear_n = hidden_size * (q_size + k_size + v_size + num_attention_heads * head_dim)
    emd_and_lm_head_n = vocab_size * hidden_size * 2
    dense_n = (mlp_n + attn_linear_n) * num_hidden_layers + emd_and_lm_head_n
    dense_n_flops = 6 * dense_n * tokens_sum
    seqlen_square_sum = sum(seqlen * seqlen for seqlen in batch_seqlens)
    attn_qkv_flops = 12 * seqlen_square_sum * head_dim * num_attention_heads * num_hidden_layers
    return (dense_n_flops + attn_qkv_flops) * (1.0 / delta_time) / 1e12


def easyr1_mfu(config: dict, global_token_num: list[int], delta_time: float, ppo_epochs: int, world_size: int,
               promised_tflops: float) -> float:
    """EasyR1 verl/workers/fsdp_workers.py update_actor: perf/mfu_actor = estimated x ppo_epochs / (promised x
    world_size), estimated over the WHOLE batch's global_token_num (attention-mask sums) and update_policy's time."""
    estimated = easyr1_llama_flops(config, sum(global_token_num), global_token_num, delta_time)
    return estimated * ppo_epochs / (promised_tflops * world_size)


@pytest.mark.parametrize("seed", range(4))
def test_text_flops_and_mfu_match_easyr1s_counter(seed, tiny_model_path):
    from vlmrl.models.families import read_model_config
    from vlmrl.models.tiny import ensure_built

    rng = random.Random(seed)
    seqlens = [rng.randint(1, 4096) for _ in range(rng.randint(1, 64))]
    seconds, epochs, gpus = rng.uniform(1, 100), rng.choice([1, 2]), rng.choice([1, 8])
    qwen3 = read_model_config(ensure_built("tiny-qwen3-vl"))  # head_dim 64 given, hidden / heads = 64 as well
    qwen3["text_config"]["head_dim"] = 96  # make EasyR1's getattr(config, "head_dim") matter
    for config in (QWEN25_VL_3B, read_model_config(tiny_model_path), qwen3):
        text = config["text_config"]
        f = model_flops(config)
        assert f.text_flops(seqlens) / seconds / 1e12 == pytest.approx(easyr1_llama_flops(text, sum(seqlens),
                                                                                          seqlens, seconds))
        # text-only rows (no grids): the same MFU as EasyR1's
        got = step_throughput(f, seqlens, [], step_seconds=1.0, update_seconds=seconds, gpus=gpus, ppo_epochs=epochs,
                              peak_flops=989e12)
        assert got["throughput/mfu_actor"] == pytest.approx(easyr1_mfu(text, seqlens, seconds, epochs, gpus, 989.0))
        # EasyR1's perf/throughput: total tokens / (step time x GPUs)
        assert got["throughput/tokens_per_s_per_gpu"] == pytest.approx(sum(seqlens) / gpus)


def _linear_params(module: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def _tiny_qwen2_vl_config():
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(text_config={"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                                      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256},
                         vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2,
                                        "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2,
                                        "temporal_patch_size": 2})


@pytest.mark.parametrize("variant", ["tiny", "tiny-qwen3-vl", "qwen2-vl", "tiny-glm4v"])
def test_the_formula_counts_the_models_own_matmul_weights(variant):
    # every nn.Linear a token or a patch goes through (and the patch embedding's Conv3d, and the embedding as EasyR1
    # counts it), counted on the instantiated model: the config is read right for each family
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlmrl.models.tiny import ensure_built

    config = _tiny_qwen2_vl_config() if variant == "qwen2-vl" else AutoConfig.from_pretrained(ensure_built(variant))
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    f = model_flops(config)
    lm = model.model.language_model
    assert f.text_params == _linear_params(lm) + lm.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    visual = model.model.visual
    mergers = [visual.merger, *getattr(visual, "deepstack_merger_list", [])]
    merger_params = sum(_linear_params(m) for m in mergers)
    if hasattr(visual, "downsample"):  # GLM-4.1V: a stride-m convolution per merged token before its merger
        merger_params += visual.downsample.weight.numel()
    m2 = config.vision_config.spatial_merge_size ** 2
    per_patch = visual.patch_embed.proj.weight.numel() + _linear_params(visual.blocks) + merger_params / m2
    assert f.vision_params == per_patch


@pytest.mark.parametrize("grid", [(1, 8, 12), (2, 20, 14), (1, 6, 6), (3, 16, 16), (1, 2, 30)])
def test_vision_attention_spans_are_transformers(grid):
    # Qwen2.5-VL's windows (get_vision_window_index) and its per-frame full attention (get_vision_cu_seqlens)
    from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index

    grid_thw = torch.tensor([grid])
    _, cu_windows = get_vision_window_index(grid_thw, spatial_merge_size=2, window_size=112, patch_size=14)
    cu_frames = get_vision_cu_seqlens(grid_thw)
    windowed = int((cu_windows.diff().long() ** 2).sum())
    full = int((cu_frames.diff().long() ** 2).sum())
    f = ModelFlops(text_params=0, text_attention=0, vision_width=1, vision_full_layers=1, vision_window_layers=1,
                   window=4, merge_size=2)
    assert f.vision_flops([grid]) == 12 * (full + windowed)


def test_device_peaks_by_whole_word():
    assert device_peak_flops("NVIDIA H100 PCIe") == 756e12 and device_peak_flops("NVIDIA H100 NVL") == 835e12
    assert device_peak_flops("NVIDIA H200") == 989e12  # EasyR1's substring test reads it as an H20 (148e12)
    assert device_peak_flops("NVIDIA L40S") == 362e12 and device_peak_flops("NVIDIA L4") == 121e12
    assert device_peak_flops("NVIDIA GeForce RTX 3060") is None and device_peak_flops("") is None


def test_step_throughput_without_a_peak_or_formula_and_with_a_frozen_tower():
    f = model_flops(QWEN25_VL_3B)
    args = {"step_seconds": 10.0, "update_seconds": 4.0, "gpus": 8}
    no_peak = step_throughput(f, [1000, 500], [[1, 28, 28]], **args)
    assert "throughput/mfu_actor" not in no_peak and no_peak["throughput/actor_tflops_per_gpu"] > 0
    assert step_throughput(None, [1000, 500], [], **args) == {"throughput/tokens": 1500.0,
                                                              "throughput/tokens_per_s_per_gpu": 1500 / 80}
    trained = step_throughput(f, [1000], [[1, 28, 28]], peak_flops=1e15, ppo_epochs=2, **args)
    frozen = step_throughput(f, [1000], [[1, 28, 28]], peak_flops=1e15, ppo_epochs=2, vision_trains=False, **args)
    expected = (f.text_flops([1000]) + f.vision_flops([[1, 28, 28]])) * 2 / (4.0 * 8) / 1e15
    assert trained["throughput/mfu_actor"] == pytest.approx(expected)
    assert frozen["throughput/mfu_actor"] == pytest.approx(
        (f.text_flops([1000]) + f.vision_flops([[1, 28, 28]], trains=False)) * 2 / (4.0 * 8) / 1e15)
    assert f.vision_flops([[1, 28, 28]], trains=False) < f.vision_flops([[1, 28, 28]]) / 2.9  # the forward's share
    assert model_flops({"model_type": "llava"}) is None
    # shared vision encodings: the work done beside the model FLOPs, less the tower's saved FLOPs
    saved = 0.5 * f.vision_flops([[1, 28, 28]]) * 2
    shared = step_throughput(f, [1000], [[1, 28, 28]], peak_flops=1e15, ppo_epochs=2, vision_flops_saved=saved,
                             **args)
    assert shared["throughput/mfu_actor"] == trained["throughput/mfu_actor"]
    done = (f.text_flops([1000]) * 2 + f.vision_flops([[1, 28, 28]]) * 2 - saved) / (4.0 * 8)
    assert shared["throughput/actor_tflops_done_per_gpu"] == pytest.approx(done / 1e12)
    assert shared["throughput/mfu_actor_done"] == pytest.approx(done / 1e15)
    assert "throughput/mfu_actor_done" not in trained


def test_batch_shapes_count_real_rows_images_and_videos():
    attention = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 0]])
    padding = torch.tensor([False, False, True])
    inputs = [{"image_grid_thw": torch.tensor([[1, 4, 6], [1, 2, 2]])},
              {"video_grid_thw": torch.tensor([[3, 4, 4]])}, {"image_grid_thw": torch.tensor([[1, 8, 8]])}]
    assert batch_shapes(attention, padding, inputs) == ([3, 5], [[1, 4, 6], [1, 2, 2], [3, 4, 4]])


def test_docstring_examples_hold():
    import doctest

    from vlmrl.trainer import throughput

    failures, tried = doctest.testmod(throughput)
    assert tried > 0 and failures == 0


def test_a_moe_layer_counts_the_experts_a_token_runs_through_as_verl_does():
    """tiny-qwen3-vl-moe: per MoE layer, top-k of the E experts' gate, up and down projections and the router (verl's
    `hidden x top-k x moe_intermediate x 3 + hidden x experts`), counted on the instantiated model's own tensors; the
    vision side as Qwen3-VL's (three deepstack mergers)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlmrl.models.tiny import ensure_built

    config = AutoConfig.from_pretrained(ensure_built("tiny-qwen3-vl-moe"))
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config)
    f = model_flops(config)
    lm = model.model.language_model
    text = config.text_config
    per_layer_experts = sum(p.numel() for n, p in lm.layers[0].mlp.named_parameters() if "experts" in n)
    active = per_layer_experts * text.num_experts_per_tok // text.num_experts
    router = lm.layers[0].mlp.gate.weight.numel()
    attention = _linear_params(lm.layers[0].self_attn)
    expected = (active + router + attention) * text.num_hidden_layers + lm.embed_tokens.weight.numel() \
        + model.lm_head.weight.numel()
    assert f.text_params == expected
    visual = model.model.visual
    merger_params = sum(_linear_params(m) for m in [visual.merger, *visual.deepstack_merger_list])
    per_patch = visual.patch_embed.proj.weight.numel() + _linear_params(visual.blocks) + merger_params / 4
    assert f.vision_params == per_patch

