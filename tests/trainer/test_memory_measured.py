"""The memory plan against what the real torch objects hold on a CPU, on the embedded models (tiny, tiny-large,
tiny-qwen3-vl-moe):

- parameters, gradients and AdamW moments: exactly the bytes the actor's tensors hold, whole on one process and
  each FSDP2 rank's shard at dp = 2 (two processes, gloo);
- the engine's weights: exactly the bytes a weight sync sends (every checkpoint tensor in the engine's dtype);
- one micro-batch's activations: the peak of the bytes torch allocates on the CPU during its forward and backward
  (the profiler's allocation events, summed in order: every tensor's allocation and free, no allocator cache or
  process memory in between) lies between the plan's lower and upper bound. The band is a rule from how autograd
  frees memory, not a margin fitted here: at the peak every layer's kept input and one layer's saved tensors are
  alive (lower), and a layer's backward adds at most gradients as large as what it saved, plus the logits chunk
  and the vision tower's (upper, what the plan reports; vlmrl.trainer.memory_activations).
"""

from __future__ import annotations

import json
import socket
import tempfile

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tests.batches import synthetic_rows
from vlmrl.actor.config import ActorConfig, LoraConfig, OptimConfig
from vlmrl.actor.forward import forward_response, micro_batch
from vlmrl.actor.local import Actor
from vlmrl.batch.padding import pad_sample, stack_samples
from vlmrl.config import Config
from vlmrl.data.config import DataConfig
from vlmrl.models.experts import ExpertShape
from vlmrl.models.families import family_for_path, read_model_config
from vlmrl.models.tiny import ensure_built
from vlmrl.processors.loading import load_processor
from vlmrl.rollout.weights import checkpoint_names, weight_sync
from vlmrl.trainer.memory_activations import MicroBatch, Precision, activation_bytes
from vlmrl.trainer.memory_model import ROOT_UNIT, model_facts
from vlmrl.trainer.memory_plan import engine_weights, memory_plan

MODELS = ("tiny", "tiny-large", "tiny-qwen3-vl-moe")


def actor_config(model: str, **overrides) -> ActorConfig:
    config = ActorConfig(model_path=str(ensure_built(model)), optim=OptimConfig(lr=1e-3), device="cpu",
                         dtype="float32", share_vision=False, logprob_chunk_size=64)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def run_config(actor: ActorConfig, dp: int = 1) -> Config:
    config = Config(actor=actor)
    config.trainer.n_gpus_per_node = dp
    return config


def batch_of(model: str, rows: int, response: int, lengths: tuple[int, ...] = (), min_pixels: int | None = None):
    """`rows` synthetic prompts with images, each answered by `response` random tokens (or by lengths[i]: padding)."""
    path = str(ensure_built(model))
    processor = load_processor(path, DataConfig(max_prompt_length=128, min_pixels=min_pixels))
    data = synthetic_rows(tempfile.mkdtemp(), max(rows, 2), 2)
    generator = torch.Generator().manual_seed(0)
    samples = []
    for i in range(rows):
        prompt = processor.prompt_inputs(processor.build_request(data[i], i))
        length = lengths[i] if lengths else response
        ids = [int(t) for t in torch.randint(100, 900, (length,), generator=generator)]
        samples.append(pad_sample(prompt, ids, prompt_length=128, response_length=response,
                                  pad_token_id=processor.pad_token_id))
    return stack_samples(samples)


def step(actor: Actor, batch) -> None:
    """One micro-batch's forward and backward, as the update runs it (logprob head by chunks, autocast)."""
    mb = micro_batch(batch, list(range(len(batch))), actor.device)
    with actor.forward_context(actor.model):
        logprobs, _ = forward_response(actor.model, mb, 1.0, True, chunk=actor.config.logprob_chunk_size)
    (-(logprobs * batch.response_mask[:, : logprobs.shape[1]]).sum()).backward()


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("model, overrides", [
    ("tiny", {}), pytest.param("tiny-large", {}, marks=pytest.mark.full),  # tiny's and the MoE's keep the count
    ("tiny-qwen3-vl-moe", {}),
    ("tiny", {"dtype": "bfloat16"}),
    ("tiny", {"lora": LoraConfig(rank=8)}),
    ("tiny-qwen3-vl-moe", {"freeze_vision_tower": True}),
])
def test_parameters_gradients_and_moments_are_the_bytes_the_actor_holds(model, overrides):
    config = actor_config(model, **overrides)
    actor = Actor(config, total_steps=1, mini_batch_samples=2)
    step(actor, batch_of(model, rows=2, response=8))
    actor.optimizer.step()
    rows = memory_plan(run_config(config), model_facts(config), device_gib=64, gpu=False, options=False).phases[0].items
    params = list(actor.model.parameters())
    moments = [state[key] for state in actor.optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]
    assert rows["policy parameters"] == tensor_bytes(params)
    assert rows["gradients"] == tensor_bytes(p.grad for p in params if p.grad is not None)
    assert rows["optimizer moments"] == tensor_bytes(moments)


@pytest.mark.parametrize("model", MODELS)
def test_the_engines_weights_are_the_bytes_a_weight_sync_sends(model):
    """Every checkpoint tensor in the engine's dtype (bfloat16): the same parameter count, tied copies once, experts
    in the checkpoint's layout."""
    config = actor_config(model)
    actor = Actor(config, total_steps=1, mini_batch_samples=2)
    path = config.model_path
    family = family_for_path(path)
    experts = (family.experts.checkpoint_layout, ExpertShape.of(read_model_config(path))) if family.experts else None
    sync = weight_sync(actor.named_tensors(), None, checkpoint_names(path), torch.bfloat16, 0, "vllm", family, experts)
    sent = sum(tensor_bytes(bucket.values()) for bucket in sync.buckets)
    assert engine_weights(model_facts(config), 1, 2) == sent


def peak_bytes(run) -> int:
    """The most bytes allocated on the CPU at once during `run()`, above what was allocated before it: torch's
    profiler records every allocation and free with its size; summed in time order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for event in events:
        now += event.nbytes()
        peak = max(peak, now)
    return peak


CASES = {  # model, gradient checkpointing, compute dtype, response tokens per row, images at the processor's most,
    # responses of other lengths (padding: sdpa gets a mask and k, v repeated to every head)
    "tiny-large, checkpointed, float32": ("tiny-large", True, "float32", 128, False, ()),
    "tiny-large, checkpointed, bfloat16 autocast": ("tiny-large", True, "bfloat16", 128, False, ()),
    "tiny-large, not checkpointed, float32": ("tiny-large", False, "float32", 64, False, ()),
    "tiny-large, checkpointed, large images, padded rows": ("tiny-large", True, "float32", 96, True, (96, 64, 32)),
    "tiny, checkpointed, float32": ("tiny", True, "float32", 256, False, ()),
    "tiny-qwen3-vl-moe, checkpointed, float32": ("tiny-qwen3-vl-moe", True, "float32", 256, False, ()),
    "tiny-qwen3-vl-moe, not checkpointed, bfloat16 autocast": ("tiny-qwen3-vl-moe", False, "bfloat16", 256, False,
                                                               ()),
}


FULL_ONLY = {"tiny-large, not checkpointed, float32", "tiny, checkpointed, float32",
             "tiny-large, checkpointed, float32"}
"""Variants make test leaves to make test-all (each costs 10-40 s on 2 cores): the MoE case keeps a run without
checkpointing, tiny-large's padded one a checkpointed float32 run."""


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.full) if case in FULL_ONLY else case
                                  for case in CASES])
def test_one_micro_batchs_activation_peak_lies_in_the_plans_band(case):
    model, checkpointing, compute, response, large_images, lengths = CASES[case]
    config = actor_config(model, gradient_checkpointing=checkpointing, compute_dtype=compute)
    actor = Actor(config, total_steps=1, mini_batch_samples=3)
    batch = batch_of(model, rows=3, response=response, lengths=lengths, min_pixels=50176 if large_images else None)
    actor.model.train()
    step(actor, batch)  # the gradients exist from here on (the plan counts them apart)
    measured = peak_bytes(lambda: step(actor, batch))
    facts = model_facts(config)
    inputs = micro_batch(batch, list(range(len(batch))), actor.device)  # the rows as the forward gets them
    patches = int(inputs.image_grid_thw.prod(-1).sum()) if inputs.image_grid_thw is not None else 0
    mb = MicroBatch(rows=len(batch), length=inputs.input_ids.shape[1], response_tokens=int(batch.response_mask.sum()),
                    image_tokens=patches // facts.vision.patches_per_token,
                    masked=bool((inputs.attention_mask == 0).any()))
    blocks = [n for unit, n in facts.trainable_units().items() if unit != ROOT_UNIT]
    acts = activation_bytes(facts.text, facts.vision, mb, Precision(4, 2 if compute == "bfloat16" else 4),
                            checkpointing, config.logprob_chunk_size, facts.trainable, max(blocks), True)
    assert acts.lower <= measured <= acts.upper, (f"{case}: measured {measured / 2**20:.1f} MiB, plan "
                                                  f"{acts.lower / 2**20:.1f}..{acts.upper / 2**20:.1f} MiB")


def _rank(rank: int, port: int, out: str) -> None:
    """One FSDP2 rank of two (gloo): the tiny actor sharded, one backward and one optimizer step, then the bytes of
    this rank's local shards written to `out`."""
    import torch.distributed as dist

    from vlmrl.distributed.actor import ShardedActor
    from vlmrl.distributed.fsdp import init_process_group

    torch.set_num_threads(1)
    init_process_group(rank, 2, "127.0.0.1", port, torch.device("cpu"), 120)
    actor = ShardedActor(actor_config("tiny"), world_size=2)
    step(actor, batch_of("tiny", rows=2, response=8))
    actor.optimizer.step()
    params = list(actor.model.parameters())
    local = [p.to_local() for p in params]
    moments = [state[key].to_local() for state in actor.optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]
    result = {"params": tensor_bytes(local), "grads": tensor_bytes(p.grad.to_local() for p in params),
              "moments": tensor_bytes(moments)}
    with open(f"{out}.{rank}", "w") as handle:
        json.dump(result, handle)
    dist.destroy_process_group()


def test_each_fsdp2_rank_holds_the_plans_shard(tmp_path):
    """dp = 2 on two processes: rank 0 holds ceil(rows / 2) of every tensor (FSDP2's padded chunk), exactly the
    plan's per-device parameters, gradients and moments; rank 1 holds the rest."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = str(tmp_path / "rank")
    mp.spawn(_rank, args=(port, out), nprocs=2, join=True)
    ranks = [json.loads(open(f"{out}.{r}").read()) for r in range(2)]
    config = actor_config("tiny")
    facts = model_facts(config)
    rows = memory_plan(run_config(config, dp=2), facts, device_gib=64, gpu=False, options=False).phases[0].items
    assert (ranks[0]["params"], ranks[0]["grads"], ranks[0]["moments"]) == (
        rows["policy parameters"], rows["gradients"], rows["optimizer moments"])
    assert ranks[0]["params"] + ranks[1]["params"] == 4 * facts.parameters  # float32, every element once
