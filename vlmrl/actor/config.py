"""Actor configuration: the policy being trained and its update (the run config's `actor` section)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlmrl.algorithms.config import KL_TYPES, LOSS_AGG_MODES, POLICY_LOSSES

PRECISIONS = ("float32", "bfloat16")
"""Precisions a run config may name for weights and compute (vlmrl.actor.policy.DTYPES also maps float64, for
tests); `auto` is added where the device decides (actor.compute_dtype, rollout.dtype)."""
LR_SCHEDULERS = ("constant", "cosine")
LORA_VISION = ("off", "tower", "merger", "tower+merger")
LORA_SYNC = ("auto", "merged", "adapter")

# The defaults of actor.lora's module keys: names shared by the Qwen-VL families (transformers-5 names). Which vision
# layers lora.vision adapts comes from the model's family (vlmrl.models.families: vision_tower, vision_mergers).
QWEN_VL_LM_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""The language model's attention and MLP projections (every anchor's LoRA default)."""
QWEN_VL_VISION = r"model\.visual\..*"
"""Everything of the vision side (the families' vision_tower): its blocks, patch embedding and mergers."""


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

    def problems(self) -> list[str]:
        """What is wrong, each with what to change; empty when valid."""
        out = []
        if self.lr <= 0:
            out.append(f"actor.optim.lr={self.lr} must be > 0")
        if len(self.betas) != 2:
            out.append(f"actor.optim.betas={self.betas} must be two numbers, e.g. [0.9, 0.999]")
        if self.lr_scheduler not in LR_SCHEDULERS:
            out.append(f"actor.optim.lr_scheduler={self.lr_scheduler!r} is not one of {list(LR_SCHEDULERS)}")
        return out


@dataclass
class LoraConfig:
    """LoRA adapters (PEFT) instead of full fine-tuning: only the adapters train and hold optimizer state, and the KL
    reference is the same model with its adapters disabled (no second copy)."""

    rank: int = 0
    """Adapter rank r; 0 = LoRA off (full fine-tuning)."""
    alpha: float = 16.0
    """Scale of the adapter update: delta W = (alpha / rank) * B @ A."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (0 keeps the update forward equal to the logprob pass)."""
    target_modules: list[str] = field(default_factory=lambda: list(QWEN_VL_LM_PROJECTIONS))
    """Language-model linear layers to adapt, by the last part(s) of their name (PEFT's rule); default its attention
    and MLP projections (and on Qwen3.5 its linear-attention layers' in_proj_qkv/z/b/a and out_proj). The vision
    side's adapters are lora.vision's alone, whatever this and exclude_modules say."""
    exclude_modules: str = QWEN_VL_VISION
    """Regex of module names target_modules never adapts (full match); default the whole vision side, as verl's
    `.*visual.*`. lora.vision adds vision layers regardless of it."""
    vision: str = "off"
    """Adapt the vision side too: off, tower (the vision blocks' attention and MLP), merger (the connector to the
    language model) or tower+merger."""
    sync: str = "auto"
    """How the rollout engine gets the weights: merged (base + scaled adapter deltas as full weights; every
    backend), adapter (the adapter itself, served as a LoRA: vllm only) or auto (adapter where the backend can,
    else merged, said once in the log)."""
    experts: bool = False
    """Mixture-of-Experts policies: adapt the routed experts too, every language MoE layer's fused
    mlp.experts.gate_up_proj and down_proj (PEFT's `target_parameters`: one rank-r adapter per expert); routers
    are never adapted. Expert adapters always sync merged (base + scaled deltas, in the engines' expert layout):
    whether vLLM serves an expert LoRA is unproven, so sync=auto picks merged and sync=adapter is refused. Needs
    dropout=0 (PEFT has no dropout on a parameter's adapter); an error on a dense model."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def may_sync_adapter(self) -> bool:
        """sync adapter or auto, and no adapter that only a merged sync carries (lora.experts): whether a backend
        that serves adapters is started to serve this policy's."""
        return self.enabled and self.sync != "merged" and not self.experts

    def problems(self) -> list[str]:
        """What is wrong, each with what to change; empty when valid."""
        out = []
        if self.rank < 0:
            out.append(f"actor.lora.rank={self.rank} must be >= 0 (0 = off; 8-64 are usual)")
        if self.enabled and self.alpha <= 0:
            out.append(f"actor.lora.alpha={self.alpha} must be > 0 (often rank or 2 x rank)")
        if not 0 <= self.dropout < 1:
            out.append(f"actor.lora.dropout={self.dropout} must be in [0, 1)")
        if self.vision not in LORA_VISION:
            out.append(f"actor.lora.vision={self.vision!r} is not one of {list(LORA_VISION)}")
        if self.sync not in LORA_SYNC:
            out.append(f"actor.lora.sync={self.sync!r} is not one of {list(LORA_SYNC)}")
        if self.enabled and not self.target_modules and self.vision == "off" and not self.experts:
            out.append("actor.lora.target_modules is empty, lora.vision=off and lora.experts=false: nothing to adapt")
        if self.enabled and self.experts and self.sync == "adapter":
            out.append("actor.lora.experts=true syncs merged weights (whether vLLM serves an expert LoRA is unproven): "
                       "set actor.lora.sync=auto or merged, or actor.lora.experts=false")
        if self.enabled and self.experts and self.dropout:
            out.append(f"actor.lora.experts=true needs actor.lora.dropout=0 (it is {self.dropout}): PEFT's adapters "
                       "on the fused expert parameters take no dropout")
        return out


@dataclass
class OffloadConfig:
    """What the actor keeps in host memory instead of on its GPU (every anchor offers it): memory for PCIe time."""

    params: bool = False
    """Sharded parameters and their gradients on the CPU (torch FSDP2 CPUOffloadPolicy); each block is copied to the
    GPU for its forward/backward and the optimizer steps on the CPU. Frees ~16 bytes/parameter of GPU memory with
    fp32 master weights and AdamW, at the cost of host<->GPU copies every step and a CPU optimizer step. Needs FSDP
    (dp >= 2); a single-device actor keeps its parameters on the device, with a warning."""
    optimizer: bool = False
    """AdamW's state (8 bytes/parameter in fp32) on the CPU between optimizer steps, moved to the GPU for each step
    (verl's optimizer offload). Implied by params."""
    reference: bool = True
    """The frozen KL reference, and a distillation teacher in the trainer, on the CPU: FSDP2 CPUOffloadPolicy when
    sharded, else moved to the GPU only for its logprob pass. Each runs once per step without a backward, so the
    copies cost little next to its weights' memory."""


ROUTING_REPLAY = ("off", "trainer", "engine")


@dataclass
class MoEConfig:
    """Mixture-of-Experts policies (Qwen3-VL-MoE, Qwen3.5-MoE); ignored for a dense model."""

    routing_replay: str = "off"
    """off: the update routes each token as its router says now; trainer (R2): the old-logprob pass records each
    token's experts and the update's forward and backward route through those (`vlmrl.actor.router_hooks`), so the
    importance ratio compares the same experts even once the optimizer has moved the routers (as verl's and slime's
    router replay). Either way, mismatch/routing_changed_frac logs the share of (token, MoE layer) pairs whose
    top-k set the update would choose differently from the old pass (with engine: the trainer's routers from the
    engine's, in the old pass and the update). Needs the old-logprob pass (more than one
    optimizer step per batch, or rollout correction recomputing them); at dp > 1 each rank records its rows and
    the rows' routing travels with them to whichever rank updates them (the metrics are the global batch's).
    engine (R3): the routing the rollout engine computed for each sample replaces the trainer's in the old-logprob
    pass and in the update, so the trainer's logprobs are of the experts the engine sampled with (verl's, slime's
    and miles's rollout routing replay). The engine reports it with its capture on: rollout.vllm.capture_routing
    (on a GPU vLLM's own `enable_return_routed_experts` in the batched generate; on a CPU vlmrl hooks the engine's
    routers, one sample at a time) or rollout.sglang.capture_routing (SGLang's, GPU only)."""

    aux_loss_coef: float = 0.0
    """Weight of the routers' load-balancing loss in the update (transformers' Switch-Transformer loss over the
    micro-batch's attended tokens, `router_aux_loss_coef` in the models' configs: 0.001). 0: off, as the anchors' RL
    runs keep it (verl's Qwen3-MoE bridge sets `moe_router_load_balancing_type="none"`, "default None for RL"); the
    update's tokens are the policy's own samples, and balancing them is pretraining's concern. Logged as
    actor/moe_aux_loss when on."""

    def problems(self) -> list[str]:
        out = []
        if self.routing_replay not in ROUTING_REPLAY:
            out.append(f"actor.moe.routing_replay={self.routing_replay!r} is not one of {list(ROUTING_REPLAY)}")
        if self.aux_loss_coef < 0:
            out.append(f"actor.moe.aux_loss_coef={self.aux_loss_coef} must be >= 0 (0 = off; the models' own: 0.001)")
        return out


@dataclass
class ActorConfig:
    model_path: str = ""
    """Policy to train: a local HF folder, a hub id, or an embedded name (`tiny`, `tiny-large`, `tiny-qwen3-vl`)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer settings."""
    ppo_mini_batch_size: int = 128
    """Prompts per optimizer step (times rollout.n samples); train_batch_size / this = updates per step."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Samples per forward/backward; micro-batches accumulate gradients. Changes memory, not the update."""
    micro_batch_tokens: int = 0
    """Token budget of one forward/backward (verl's ppo_max_token_len_per_gpu, EasyR1's dynamic batching): rows are
    packed into micro-batches that process at most this many tokens each (padded: rows x (longest prompt + longest
    response); with padding_free: the rows' summed lengths), sharded ranks are given rows of equal token totals; a
    row longer than the budget runs alone (with a warning). 0 = fixed rows (ppo_micro_batch_size_per_gpu). Changes
    memory and speed, not the update."""
    share_vision: bool = True
    """Encode each distinct image (and video) of a forward once: the rows of a micro-batch that carry the same
    pixels (the n samples of a GRPO prompt) share one vision-tower forward, and the backward sums the shared
    features' gradients (`vlmrl.actor.vision_share`). Same logprobs and losses as one tower forward per row, and the
    same gradients up to their summation order but for the tower's, which agree to float32 rounding even in float64:
    transformers computes parts of the tower in float32 whatever the model's dtype (Qwen2.5-VL's and GLM-4.1V's
    RMSNorm, the rotary), and the backward of that cast rounds the shared gradient once, the per-row ones each.
    Less vision compute the more rows of a group share a micro-batch. false: a tower forward per row, as verl and
    EasyR1 run it. Logs actor/vision_items and actor/vision_items_encoded per update. With
    padding_free and micro_batch_tokens, a prompt's samples that fit one pack are planned together."""
    padding_free: bool = False
    """Packed forward (verl's use_remove_padding, EasyR1's padding_free): a micro-batch's rows run as one sequence
    without padding, attention kept within each row and each row's own 3D position ids. Same logprobs; no compute
    spent on padding. On CUDA with flash-attention (varlen), else sdpa/eager with a block-diagonal mask."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    policy_loss: str = "ppo-clip"
    """Policy loss: ppo-clip (token ratio, dual-clip), gspo (sequence-level ratio, GSPO; set clip_ratio_low/high to
    its ~3e-4/4e-4), cispo (clipped, detached IS weight times logprob: every token keeps a gradient) or sapo (a
    sigmoid soft gate instead of a hard clip, SAPO; its width is sapo_tau_pos/neg, clip_ratio* do not apply)."""
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
    sapo_tau_pos: float = 1.0
    """sapo: temperature of the soft gate for positive-advantage tokens (> 0; the paper's, EasyR1's, verl's and TRL's
    1.0). Larger = the gradient fades faster as the token ratio leaves 1."""
    sapo_tau_neg: float = 1.05
    """sapo: temperature for the other tokens (> 0; the paper's 1.05, above sapo_tau_pos: negative updates are the
    less stable side and fade faster)."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus (loss -= entropy_coeff * token-mean entropy)."""
    use_kl_loss: bool = False
    """Add a KL loss to a frozen reference (the initial weights). Loads a second copy of the model, except with LoRA
    (the reference is then the model with its adapters disabled)."""
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
    logprob_chunk_size: int = 256
    """Response tokens whose full-vocabulary logits exist at once in the logprob/entropy pass (each chunk's logits
    are recomputed in the backward); 0 = all of a micro-batch's at once. At Qwen2.5-VL's 151,936 tokens one
    float32 token row is 0.6 MB: 256 tokens make 156 MB per copy where 4 rows x 2048 tokens unchunked make 5 GB.
    Changes memory, not the values."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Host-memory offload of parameters, optimizer state and the reference."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward (less memory, ~30% slower)."""
    device: str = "auto"
    """Torch device for the actor: auto (cuda when available, else cpu), cpu, cuda, cuda:N."""
    mismatch_metrics: bool = True
    """Log the trainer/engine mismatch of the tokens each update uses (mismatch/*: k1 and k3 KL, chi-square, IS
    effective sample size, perplexity ratio, IS-ratio quantiles, max and p99 |dlogp|, per data source, modality and engine;
    docs/alignment.md). From the update's own pre-update logprobs: no extra forward. Needs rollout.temperature=1 (the
    engines return the untempered distribution's logprobs)."""
    mismatch_threshold: float = 0.1
    """|trainer - engine| logprob gap above which a token counts in mismatch/over_threshold."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters (lora.rank > 0) instead of full fine-tuning."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture-of-Experts settings (routing replay)."""

    def policy_loss_kwargs(self) -> dict[str, float | None]:
        """The keyword arguments of `POLICY_LOSS_FNS[policy_loss]` besides the tensors: the clip range (clip_ratio
        where clip_ratio_low / _high are null), the dual-clip cap, and SAPO's temperatures for sapo."""
        kwargs: dict[str, float | None] = {
            "clip_ratio_low": self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low,
            "clip_ratio_high": self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high,
            "clip_ratio_c": self.clip_ratio_c,
        }
        if self.policy_loss == "sapo":
            kwargs.update(tau_pos=self.sapo_tau_pos, tau_neg=self.sapo_tau_neg)
        return kwargs

    def problems(self) -> list[str]:
        """What is wrong, each with what to change; empty when valid."""
        out = []
        if not self.model_path:
            out.append("actor.model_path is empty: set a HF model folder, a hub id, or `tiny`")
        for name in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs"):
            if getattr(self, name) < 1:
                out.append(f"actor.{name}={getattr(self, name)} must be >= 1")
        if self.micro_batch_tokens < 0:
            out.append(f"actor.micro_batch_tokens={self.micro_batch_tokens} must be >= 0 (0 = fixed rows of "
                       "ppo_micro_batch_size_per_gpu; e.g. 16384 packs micro-batches to 16k tokens)")
        if not self.mismatch_threshold > 0:
            out.append(f"actor.mismatch_threshold={self.mismatch_threshold} must be > 0 (0.1 = a 10% probability gap)")
        if self.logprob_chunk_size < 0:
            out.append(f"actor.logprob_chunk_size={self.logprob_chunk_size} must be >= 0 (0 = unchunked; 256 keeps "
                       "the logits of a 152k vocabulary small)")
        if self.use_kl_loss and self.kl_loss_coef <= 0:
            out.append("actor.use_kl_loss=true with kl_loss_coef=0 loads a reference model for nothing: set "
                       "actor.kl_loss_coef > 0 (e.g. 0.01) or actor.use_kl_loss=false")
        if self.kl_loss_coef > 0 and not self.use_kl_loss:
            out.append(f"actor.kl_loss_coef={self.kl_loss_coef} needs a reference model: set actor.use_kl_loss=true, "
                       "or kl_loss_coef=0")
        if self.kl_loss_type not in KL_TYPES:
            out.append(f"actor.kl_loss_type={self.kl_loss_type!r} is not one of {list(KL_TYPES)}")
        if not 0 < self.clip_ratio < 1:
            out.append(f"actor.clip_ratio={self.clip_ratio} must be in (0, 1) (0.2 is standard)")
        if self.clip_ratio_high is not None and self.clip_ratio_high <= 0:
            out.append("actor.clip_ratio_high must be > 0 (or null)")
        if self.policy_loss not in POLICY_LOSSES:
            out.append(f"actor.policy_loss={self.policy_loss!r} is not one of {list(POLICY_LOSSES)}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            out.append(f"actor.loss_agg_mode={self.loss_agg_mode!r} is not one of {list(LOSS_AGG_MODES)}")
        if self.clip_ratio_low is not None and self.clip_ratio_low <= 0:
            out.append("actor.clip_ratio_low must be > 0 (or null)")
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1:
            out.append(f"actor.clip_ratio_c={self.clip_ratio_c} must be > 1 (3 is verl's default) or null (no "
                       "dual-clip)")
        if self.policy_loss == "gspo" and (self.clip_ratio_low is None or self.clip_ratio_high is None):
            out.append("actor.policy_loss=gspo clips a sequence-level ratio, which moves far less than a token's: set "
                       "actor.clip_ratio_low and actor.clip_ratio_high explicitly (the GSPO paper: 3e-4 and 4e-4)")
        for name in ("sapo_tau_pos", "sapo_tau_neg"):
            if not getattr(self, name) > 0:
                out.append(f"actor.{name}={getattr(self, name)} must be > 0 (SAPO's gate is 4 / tau * sigmoid(tau * "
                           "(ratio - 1)); the paper uses 1.0 and 1.05)")
        if self.dtype not in PRECISIONS:
            out.append(f"actor.dtype={self.dtype!r} must be float32 or bfloat16")
        if self.compute_dtype not in ("auto", *PRECISIONS):
            out.append(f"actor.compute_dtype={self.compute_dtype!r} must be auto, float32 or bfloat16")
        if self.lora.enabled and self.freeze_vision_tower and self.lora.vision != "off":
            out.append(f"actor.freeze_vision_tower=true with actor.lora.vision={self.lora.vision}: the tower's adapters "
                       "would train anyway; set one of them back")
        return out + self.optim.problems() + self.lora.problems() + self.moe.problems()
