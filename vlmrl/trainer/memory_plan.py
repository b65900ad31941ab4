"""The memory plan: what one device holds in each phase of a step, for a run config and a device size.

    plan = memory_plan(config, model_facts(config.actor), device_gib=80)   # plan.fits, plan.peak, plan.smallest_tp

Per device, in bytes (GiB in the table), phase by phase (`python -m vlmrl.plan` prints it; docs/memory.md says
what each row counts and how it was checked):

- the trainer's resident state: its FSDP2 shard (1/dp, dim 0 padded as `fully_shard` pads it) of the parameters in
  actor.dtype, of their gradients (made by the first backward and kept until the next update's zero_grad, so through
  the rollout), of AdamW's two moments; actor.offload moves them (and the reference) to host memory;
- the colocated engine at rollout.tensor_parallel_size k (one engine per k training devices): awake it takes
  rollout.gpu_memory_utilization of the device (vLLM fills it with its weights, 1/k of the checkpoint in the
  engine dtype, its profiled activations and the KV cache; SGLang's fraction holds weights and KV cache, its
  activations come on top); asleep (vLLM's sleep mode, SGLang's memory saver: on for colocated engines on GPUs) it
  holds nothing there, from the step's first training call until the weight sync wakes its weights and the next
  generate its KV cache (`vlmrl.rollout.base.release_memory`);
- per phase: the rollout (resident + awake engine), the old/reference logprob passes (no-grad forwards), the update
  (FSDP2's gathered units, the activations of one micro-batch: `vlmrl.trainer.memory_activations`), the optimizer
  step (AdamW's foreach temporaries) and the weight sync (the engine's weights back, one gathered tensor);
- a runtime reserve per device (CUDA contexts of the trainer's and the engine's processes, NCCL buffers);
- with on-policy distillation, the teacher (`teacher_plan`): in the trainer its shard like the reference's (in its
  own dtype, offloaded with it), its no-grad pass in the logprobs phase; on an engine of its own its share of the
  device while it scores, and the first step's check that loads it in the trainer once.

The verdict: the largest phase within the device and an engine whose KV cache holds at least one
max_prompt_length + max_response_length request (vLLM refuses to start otherwise), at the configured k and at
every k that divides dp and the model's head counts (the smallest that fits is reported).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from vlmrl.config import Config, tensor_parallel_problems
from vlmrl.models.families import family_of
from vlmrl.trainer.memory_activations import (
    FLOAT32,
    MicroBatch,
    Precision,
    activation_bytes,
    forward_bytes,
)
from vlmrl.trainer.memory_model import ROOT_UNIT, ModelFacts

GIB = 2**30
RUNTIME_GIB = 2.0
"""Per GPU outside every tensor the plan counts: the CUDA contexts of the trainer's and the engine's processes
(~0.5 GiB each), NCCL's buffers and the caching allocator's slack. A rule of thumb, not a measurement."""
CUDA_GRAPHS_GIB = 1.0
"""vLLM's and SGLang's captured CUDA graphs (eager mode off); vLLM counts them inside its memory fraction."""
ENGINE_SEQUENCES = 256
"""Sequences an engine samples at once at most (vLLM's and SGLang's default max_num_seqs): its logits buffer."""
BYTES = {"float32": 4, "bfloat16": 2, "float64": 8}
PHASES = ("rollout", "weight sync", "logprobs", "update", "optimizer step")


@dataclass
class Phase:
    name: str
    items: dict[str, int] = field(default_factory=dict)
    """Row label -> bytes on the device in this phase."""

    @property
    def total(self) -> int:
        return sum(self.items.values())


@dataclass
class EnginePlan:
    """One colocated engine rank."""

    backend: str
    tp: int
    budget: int
    """Its memory while awake (the fraction of the device; SGLang: plus its activations)."""
    weights: int
    reserve: int
    """Profiled activations and CUDA graphs (inside the fraction for vLLM)."""
    kv_cache: int
    kv_tokens: int
    sequences: int
    """Requests of max_model_len tokens its KV cache holds at once."""
    releases: bool
    """It gives its memory back while the trainer computes."""
    sleep: str
    """What it does between rollouts, in words."""


@dataclass
class MemoryPlan:
    model: str
    family: str
    source: str
    parameters: int
    trainable: int
    dp: int
    tp: int
    device: int
    phases: list[Phase]
    engine: EnginePlan | None
    host: dict[str, int]
    """Per device, what waits in host memory (offloaded state, a sleeping engine's weights)."""
    micro_batch: MicroBatch
    activations: tuple[int, int]
    """(lower, upper) bound of one micro-batch's activations; the update phase counts the upper."""
    problems: list[str]
    """Why it does not fit (empty when it fits)."""
    options: dict[int, tuple[bool, float, str]] = field(default_factory=dict)
    """Every candidate k -> (fits, peak GiB, why not)."""

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda phase: phase.total)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def smallest_tp(self) -> int | None:
        return min((k for k, (ok, _, _) in self.options.items() if ok), default=None)


def precision(config: Config, gpu: bool) -> Precision:
    """Master and compute bytes (compute_dtype auto: bfloat16 on a GPU, the master dtype elsewhere)."""
    master = BYTES[config.actor.dtype]
    compute = config.actor.compute_dtype
    compute_bytes = (2 if gpu else master) if compute == "auto" else BYTES[compute]
    return Precision(stream=master, compute=min(master, compute_bytes))


def engine_bytes(config: Config, family_cpu_dtype: str | None, gpu: bool) -> int:
    dtype = config.rollout.dtype
    if dtype == "auto":
        dtype = "bfloat16" if gpu else (family_cpu_dtype or "float32")
    return BYTES[dtype]


def micro_batch(config: Config, facts: ModelFacts) -> MicroBatch:
    """The largest micro-batch the config allows: actor.micro_batch_tokens (a row over it alone) or
    ppo_micro_batch_size_per_gpu rows, every row max_prompt + max_response long, every prompt carrying as many
    image tokens as data.max_pixels and data.max_prompt_length allow."""
    a, d = config.actor, config.data
    longest = d.max_prompt_length + d.max_response_length
    rows = max(1, a.micro_batch_tokens // longest) if a.micro_batch_tokens else a.ppo_micro_batch_size_per_gpu
    image = 0
    if facts.vision is not None:
        per_image = d.max_pixels // facts.vision.token_pixels if d.max_pixels else d.max_prompt_length
        image = min(d.max_prompt_length, config.rollout.limit_images * per_image)
    return MicroBatch(rows=rows, length=longest, response_tokens=rows * d.max_response_length,
                      image_tokens=rows * image, packed=a.padding_free)


def kv_per_token(facts: ModelFacts, k: int, dtype_bytes: int) -> int:
    """KV cache bytes one token takes on one of k engine ranks (a rank keeps at least one whole KV head)."""
    t = facts.text
    heads = max(t.kv_heads / k, 1)
    return int(2 * t.attention_layers * heads * t.head_dim * dtype_bytes)


def linear_state_per_sequence(facts: ModelFacts, k: int, dtype_bytes: int) -> int:
    """A linear-attention model's recurrent and convolution state per sequence on one rank (float32 recurrent)."""
    t = facts.text
    layers = t.layers - t.attention_layers
    if not layers:
        return 0
    recurrent = t.linear_value_heads * t.linear_key_dim * t.linear_value_dim * FLOAT32
    conv = (2 * t.linear_key_heads * t.linear_key_dim + t.linear_value_heads * t.linear_value_dim) * dtype_bytes
    return int(layers * (recurrent + conv * max(t.linear_conv_kernel - 1, 0)) / k)


def engine_weights(facts: ModelFacts, k: int, dtype_bytes: int) -> int:
    """One of k ranks' weights: the checkpoint's parameters split k ways, KV projections kept whole-head."""
    base = [t for t in facts.tensors if ".lora_" not in t.name]
    kv = sum(t.numel for t in base if t.kv)
    rest = sum(t.numel for t in base) - kv
    return int((rest / k + kv * max(1 / k, 1 / facts.text.kv_heads)) * dtype_bytes)


def engine_reserve(config: Config, facts: ModelFacts, k: int, dtype_bytes: int, gpu: bool) -> int:
    """What the engine's profiling run takes besides weights and KV cache: one step of max_num_batched_tokens
    through a layer (hidden states and the MLP's split width), the sampler's float32 logits, the vision encoder on
    the largest images, and CUDA graphs."""
    t, r = facts.text, config.rollout
    longest = config.data.max_prompt_length + config.data.max_response_length
    batched = max(r.vllm.max_num_batched_tokens, longest) if r.name == "vllm" else longest
    width = t.top_k * t.expert_intermediate + t.shared_expert_intermediate if t.moe_layers else t.intermediate
    hidden = batched * (4 * t.hidden + (t.heads * t.head_dim + 2 * t.kv_heads * t.head_dim + 2 * width) // k)
    out = hidden * dtype_bytes + ENGINE_SEQUENCES * t.vocab * FLOAT32
    if facts.vision is not None:
        v = facts.vision
        patches = min(config.data.max_prompt_length * r.limit_images, batched) * v.patches_per_token
        out += patches * (4 * v.hidden + 2 * v.intermediate // k) * dtype_bytes
    eager = (not gpu) if r.vllm.enforce_eager is None else r.vllm.enforce_eager
    graphs = 0 if (r.name == "vllm" and eager) or r.name == "hf" or not gpu else int(CUDA_GRAPHS_GIB * GIB)
    return out + graphs


def releases_memory(config: Config, gpu: bool, colocated: bool) -> bool:
    """Whether the engine gives its memory back between rollouts (`vlmrl.rollout.base.release_memory`'s rule)."""
    r = config.rollout
    setting = {"vllm": r.vllm.enable_sleep_mode, "sglang": r.sglang.enable_memory_saver,
               "sglang-server": r.sglang.enable_memory_saver}.get(r.name, False)
    return (gpu and colocated) if setting is None else bool(setting)


def plan_engine(config: Config, facts: ModelFacts, k: int, device: int, gpu: bool, colocated: bool,
                cpu_dtype: str | None) -> EnginePlan:
    r = config.rollout
    b = engine_bytes(config, cpu_dtype, gpu)
    weights = engine_weights(facts, k, b)
    longest = config.data.max_prompt_length + config.data.max_response_length
    if r.name == "hf":  # transformers generate: the model in the engine dtype, a KV cache that grows per batch
        return EnginePlan("hf", 1, weights, weights, 0, 0, 0, 0, False, "keeps its weights on the device (hf)")
    reserve = engine_reserve(config, facts, k, b, gpu)
    fraction = int(r.gpu_memory_utilization * device)
    if r.name == "vllm":  # weights, activations, graphs and KV cache all inside the fraction
        budget, kv = fraction, fraction - weights - reserve
    else:  # SGLang's static fraction: weights and KV cache; activations and graphs come on top
        budget, kv = fraction + reserve, fraction - weights
    per_token = kv_per_token(facts, k, b)
    state = linear_state_per_sequence(facts, k, b)
    tokens = max(kv, 0) // per_token if per_token else 0
    sequences = max(kv, 0) // (longest * per_token + state) if per_token + state else 0
    releases = releases_memory(config, gpu, colocated)
    if not releases:
        sleep = "keeps its memory between rollouts (sleep mode / memory saver off)"
    elif r.name == "vllm":
        sleep = ("sleeps while the trainer computes: KV cache dropped, weights to host memory (sleep level 1)"
                 if r.vllm.sleep_level == 1 else "sleeps while the trainer computes: KV cache and weights dropped "
                 "(sleep level 2; the sync sends every weight)")
    else:
        backup = r.sglang.engine_kwargs.get("enable_weights_cpu_backup")
        sleep = ("releases its memory while the trainer computes: KV cache and CUDA graphs dropped, weights "
                 + ("to host memory" if backup else "dropped (the sync sends every weight)"))
    return EnginePlan(r.name, k, budget, weights, reserve, kv, tokens, sequences, releases, sleep)


def _gib(value: float) -> float:
    return round(value / GIB, 2)


@dataclass
class TrainerState:
    """The trainer's own bytes on one device and in host memory."""

    resident: dict[str, int]
    """What stays on the device in every phase (parameters, gradients, moments, a reference kept there)."""
    host: dict[str, int]
    moments: int
    """AdamW's two moments of this device's shard (on the device for the step, offloaded or not)."""
    visiting_reference: int
    """A single device's offloaded reference, on the device for its logprob pass."""


def trainer_state(config: Config, facts: ModelFacts, dp: int, master: int) -> TrainerState:
    """FSDP2 shards of parameters, gradients and moments, where actor.offload puts them."""
    a = config.actor

    def shard(pick) -> int:
        return sum(x.shard_numel(dp) for x in facts.tensors if pick(x)) * master

    params, grads = shard(lambda x: True), shard(lambda x: x.trainable)
    moments = 2 * grads
    on_host = a.offload.params and dp > 1  # CPUOffloadPolicy: parameters and gradients (and so the step) on the CPU
    moments_on_host = a.offload.optimizer or on_host
    reference = a.use_kl_loss and not a.lora.enabled  # LoRA's reference is the base with adapters off: no copy
    ref_bytes = (params if dp > 1 else facts.parameters * master) if reference else 0
    resident = {"policy parameters": 0 if on_host else params, "gradients": 0 if on_host else grads,
                "optimizer moments": 0 if moments_on_host else moments,
                "reference": 0 if a.offload.reference else ref_bytes}
    host = {"policy parameters": params if on_host else 0, "gradients": grads if on_host else 0,
            "optimizer moments": moments if moments_on_host else 0,
            "reference": ref_bytes if a.offload.reference else 0}
    visiting = ref_bytes if dp == 1 and a.offload.reference else 0
    return TrainerState(resident, host, 0 if on_host else moments, visiting)


@dataclass
class TeacherPlan:
    """On-policy distillation's teacher (algorithm.distill) on one device: in the trainer (its FSDP2 shard, offloaded
    with the reference by actor.offload.reference) or on an engine of its own."""

    resident: int = 0
    """The trainer-side teacher's weights kept on the device in every phase."""
    host: dict[str, int] = field(default_factory=dict)
    """What waits in host memory: the offloaded teacher, or a sleeping teacher engine's weights."""
    passes: int = 0
    """Its logprob pass on the device: a no-grad forward of the teacher, a single device's offloaded teacher whole,
    and (an engine teacher) the first step's check, the teacher loaded in the trainer once."""
    gathered: int = 0
    """The FSDP2 units of the sharded teacher gathered for its pass (dp > 1)."""
    engine: int = 0
    """An engine teacher's share of the device while awake (its scoring, in the logprobs phase)."""
    engine_always: bool = False
    """The teacher's engine keeps its memory through every phase (it cannot sleep: a CPU run)."""


def teacher_plan(config: Config, teacher: ModelFacts | None, dp: int, device: int, gpu: bool, mb: MicroBatch,
                 p: Precision) -> TeacherPlan:
    """What the teacher holds, from its own model facts (another size of the student's family) in
    algorithm.distill.teacher_dtype (auto: bfloat16 on a GPU, else the family's CPU dtype or float32)."""
    d, a = config.algorithm.distill, config.actor
    if teacher is None or not d.enabled:
        return TeacherPlan()
    dtype = d.teacher_dtype if d.teacher_dtype != "auto" else "bfloat16" if gpu else (
        family_of(teacher.config).engines.cpu_engine_dtype if teacher.config else None) or "float32"
    b = BYTES[dtype]
    whole = teacher.base_parameters * b
    forward = forward_bytes(teacher.text, teacher.vision, mb, Precision(stream=b, compute=min(b, p.compute)),
                            a.logprob_chunk_size)
    if d.served_by_url:  # on the server's own devices; the first step's check loads it in the driver's process
        check = whole + forward if d.engine_check_samples > 0 else 0
        if dp > 1:  # the driver holds no training device: its host memory
            return TeacherPlan(host={"teacher (first-step check, in the driver)": check} if check else {})
        return TeacherPlan(passes=check)
    if d.teacher_engine != "trainer":
        releases = gpu  # started colocated: vLLM's sleep mode / SGLang's memory saver on a GPU
        asleep = {"teacher engine weights (asleep)": whole} if releases and d.teacher_engine == "vllm" else {}
        check = whole + forward if d.engine_check_samples > 0 else 0
        return TeacherPlan(host=asleep, passes=check, engine=int(d.teacher_gpu_memory_utilization * device),
                           engine_always=not releases)
    weights = sum(x.shard_numel(dp) for x in teacher.tensors) * b if dp > 1 else whole
    offloaded = a.offload.reference and (dp > 1 or gpu)  # one device moves it to the CPU on a GPU only
    visiting = whole if offloaded and dp == 1 else 0
    return TeacherPlan(resident=0 if offloaded else weights, host={"teacher": weights} if offloaded else {},
                       passes=forward + visiting, gathered=gathered_units(teacher, dp, b)[0])


def gathered_units(facts: ModelFacts, dp: int, master: int) -> tuple[int, int]:
    """(a forward's, an update's) FSDP2 units gathered in full at dp > 1: the root unit's parameters from the forward
    to the end of the backward, two blocks (the one computing, the one prefetched); the update adds the root's and
    one block's unsharded gradients before their reduce-scatter."""
    if dp == 1:
        return 0, 0
    units, trained = facts.units(), facts.trainable_units()
    block = max((n for u, n in units.items() if u != ROOT_UNIT), default=0)
    block_grads = max((n for u, n in trained.items() if u != ROOT_UNIT), default=0)
    forward = (units.get(ROOT_UNIT, 0) + 2 * block) * master
    return forward, forward + (trained.get(ROOT_UNIT, 0) + block_grads) * master


def memory_plan(config: Config, facts: ModelFacts, device_gib: float = 80.0, tp: int | None = None,
                gpu: bool = True, options: bool = True, teacher: ModelFacts | None = None) -> MemoryPlan:
    """The plan of `config` on devices of `device_gib` GiB at engine TP `tp` (default rollout.tensor_parallel_size),
    with the verdict at every candidate k when `options`. `gpu` False plans a CPU run (float32 compute, no runtime
    reserve, engines that keep their memory): what the tests measure. `teacher`: the distillation teacher's model
    facts (algorithm.distill.teacher), counted as `teacher_plan` says."""
    from vlmrl.trainer.components import run_layout  # the run's own layout record (imports the run's components)

    a, r = config.actor, config.rollout
    layout = replace(run_layout(config), tp=tp or r.tensor_parallel_size)
    k, dp, device, p = layout.tp, layout.dp, int(device_gib * GIB), precision(config, gpu)
    cpu_dtype = family_of(facts.config).engines.cpu_engine_dtype if facts.config else None
    trainer = trainer_state(config, facts, dp, p.stream)
    gathered_forward, gathered_update = gathered_units(facts, dp, p.stream)
    mb = micro_batch(config, facts)
    block_grads = max((n for u, n in facts.trainable_units().items() if u != ROOT_UNIT), default=0)
    vision = family_of(facts.config).weights.vision_prefixes if facts.config else VISION_PREFIXES
    vision_trains = any(x.trainable and x.name.startswith(vision) for x in facts.tensors)
    acts = activation_bytes(facts.text, facts.vision, mb, p, a.gradient_checkpointing, a.logprob_chunk_size,
                            facts.trainable, block_grads, vision_trains)
    no_grad = forward_bytes(facts.text, facts.vision, mb, p, a.logprob_chunk_size)
    cache = 2 * facts.trainable if p.autocast else 0  # the policy's forward casts its trainable weights, grad or not

    # an engine on the training devices: colocated groups (or, on one device, the run's own engine), not rollout
    # workers of their own nor a server given by URL
    colocated = not layout.rollout_workers and not (r.name == "sglang-server" and r.server.url)
    engine = plan_engine(config, facts, k, device, gpu, colocated, cpu_dtype) if colocated else None
    awake = {"engine (awake)": engine.budget} if engine else {}
    idle = {"engine (awake)": engine.budget} if engine and not engine.releases else {}
    host = dict(trainer.host)
    if engine and engine.releases and r.name == "vllm" and r.vllm.sleep_level == 1:
        host["engine weights (asleep)"] = engine.weights
    # a sync gathers one tensor at a time (dp > 1) and casts it to the engine's dtype
    largest = max(x.numel for x in facts.tensors)
    gathered = largest * ((p.stream if dp > 1 else 0) + engine_bytes(config, cpu_dtype, gpu))
    synced = {"engine weights": engine.weights} if engine and engine.releases else idle
    runtime = {"runtime (CUDA contexts, NCCL)": int(RUNTIME_GIB * GIB) if gpu else 0}
    t = teacher_plan(config, teacher, dp, device, gpu, mb, p)
    host.update(t.host)
    resident = {**trainer.resident, **({"teacher": t.resident} if t.resident else {})}
    teaching = {"teacher engine (awake)": t.engine} if t.engine else {}  # scoring in the logprobs phase
    always = teaching if t.engine_always else {}
    phases = [
        Phase("rollout", {**resident, **awake, **always, **runtime}),
        Phase("weight sync", {**resident, **synced, "gathered tensor": gathered, **always, **runtime}),
        # one pass at a time: the policy's (its autocast copies), the reference's, the teacher's (an offloaded one
        # visiting whole; an engine teacher's first-step check, counted beside its awake engine: an upper bound)
        Phase("logprobs", {**resident, **idle, "FSDP2 gathered units": max(gathered_forward, t.gathered),
                           "forward (no grad)": max(no_grad + max(cache, trainer.visiting_reference), t.passes),
                           **teaching, **runtime}),
        Phase("update", {**resident, **idle, "FSDP2 gathered units": gathered_update, "activations": acts.upper,
                         **always, **runtime}),
        Phase("optimizer step", {**resident, **idle, "optimizer moments": trainer.moments,
                                 "AdamW temporaries": trainer.moments // 2, **always, **runtime}),
    ]
    plan = MemoryPlan(model=facts.model, family=facts.family, source=facts.source, parameters=facts.base_parameters,
                      trainable=facts.trainable, dp=dp, tp=k, device=device, phases=phases, engine=engine, host=host,
                      micro_batch=mb, activations=(acts.lower, acts.upper),
                      problems=verdict_problems(config, phases, engine, device))
    if options:
        for candidate in tp_candidates(dp):
            reason = head_problem(candidate, facts)
            other = None if reason else memory_plan(config, facts, device_gib, candidate, gpu, options=False,
                                                    teacher=teacher)
            plan.options[candidate] = ((False, 0.0, reason) if other is None else
                                       (other.fits, _gib(other.peak.total), "; ".join(other.problems)))
    return plan


def verdict_problems(config: Config, phases: list[Phase], engine: EnginePlan | None, device: int) -> list[str]:
    """Why the plan does not fit (empty when it does): a phase over the device, an engine without KV cache."""
    problems = []
    peak = max(phases, key=lambda phase: phase.total)
    if peak.total > device:
        problems.append(f"the {peak.name} phase needs {_gib(peak.total)} GiB of {_gib(device)} GiB per device")
    if engine and engine.backend != "hf" and engine.sequences < 1:
        r = config.rollout
        problems.append(f"at TP {engine.tp} the engine's weights ({_gib(engine.weights)} GiB) and activations "
                        f"({_gib(engine.reserve)} GiB) leave its {_gib(engine.budget)} GiB (rollout."
                        f"gpu_memory_utilization={r.gpu_memory_utilization}) no KV cache for a "
                        f"{config.derived.max_model_len}-token request")
    return problems


def tp_candidates(dp: int) -> list[int]:
    """The degrees a colocated engine may take: the divisors of dp (k consecutive training ranks host one)."""
    return [k for k in range(1, dp + 1) if dp % k == 0]


def head_problem(k: int, facts: ModelFacts) -> str:
    """Why an engine cannot split this model k ways ("" when it can): the run's own rule
    (`vlmrl.config.tensor_parallel_problems`: whole query heads per rank, KV heads split or replicated)."""
    return "; ".join(tensor_parallel_problems(k, facts.config, facts.model))


VISION_PREFIXES = ("model.visual.", "model.vision_tower.")
"""The vision side's parameter names when the plan has no model config to ask the family (the family's
`weights.vision_prefixes` otherwise: InternVL's projector outside its tower among them)."""
