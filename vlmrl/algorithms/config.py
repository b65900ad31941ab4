"""Algorithm configuration (the run config's `algorithm` section) and the names the GRPO math accepts.

Kept free of torch so that loading a run config does not import it; `vlmrl.algorithms.grpo` takes its KL names
from here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

KL_TYPES = ("low_var_kl", "k1", "k2", "mse")
"""KL estimators of `vlmrl.algorithms.grpo.kl_penalty` (actor.kl_loss_type)."""
ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
"""Advantage estimators of `vlmrl.algorithms.advantages` (algorithm.adv_estimator)."""
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""Loss aggregation modes of `vlmrl.algorithms.aggregation` (actor.loss_agg_mode)."""
POLICY_LOSSES = ("ppo-clip", "gspo", "cispo", "sapo")
"""Policy losses of `vlmrl.algorithms.policy_loss` (actor.policy_loss)."""
ROLLOUT_CORRECTIONS = ("off", "token_tis", "token_icepop", "seq_mis", "seq_rs", "bypass")
"""Rollout corrections of `vlmrl.algorithms.correction` (algorithm.rollout_correction)."""
SEQ_RATIOS = ("product", "geometric")
"""How seq_rs forms a sequence's ratio (algorithm.rollout_correction_seq_ratio); seq_mis takes the product."""
DISTILL_MODES = ("advantage", "loss")
"""How on-policy distillation uses the teacher (algorithm.distill.mode; `vlmrl.algorithms.distill`)."""
DISTILL_ESTIMATORS = ("k1", "k3", "forward_kl_topk")
"""The distillation loss (algorithm.distill.estimator): verl's reverse-KL estimators `k1` and `k3` (low_var_kl) of
the sampled tokens, and its `forward_kl_topk` over the teacher's top-k tokens."""
TEACHER_ENGINES = ("trainer", "hf", "vllm", "sglang", "sglang-server")
"""Where the distillation teacher runs (algorithm.distill.teacher_engine): frozen in the trainer, or on a rollout
backend of its own that scores the student's samples (`RolloutBackend.score`): an engine in this process, or an
SGLang server (at algorithm.distill.teacher_url, or one vlmrl launches)."""
TEACHER_ENGINE_PACKAGES = {"vllm": "vllm", "sglang": "sglang", "sglang-server": "sglang"}
"""The package each engine teacher needs installed (a server given by URL needs none)."""


@dataclass
class DistillConfig:
    """On-policy distillation (`algorithm.distill`): a frozen teacher in the trainer scores the student's own samples
    (the same rows, images and image tokens) token by token, and the student moves toward it by the reverse KL on its
    sampled tokens. Off while `teacher` is empty."""

    teacher: str = ""
    """The teacher: a model folder, an embedded name (`tiny-large`) or a hub id, resolved like actor.model_path. Same
    family and vocabulary as the student (another size of the family is the normal case); empty = off."""
    teacher_dtype: str = "auto"
    """The teacher's weights: auto (bfloat16 on CUDA, float32 elsewhere), float32 or bfloat16; on an engine, the
    engine's dtype (auto: as rollout.dtype's auto)."""
    teacher_engine: str = "trainer"
    """Where the teacher runs: trainer (frozen beside the policy, FSDP-sharded like the reference at dp > 1), or an
    engine of its own (vllm, sglang; hf: transformers' reference backend; sglang-server: an SGLang server, at
    teacher_url or launched) started with the run from the rollout section's options (its deadlines, engine_kwargs)
    in teacher_dtype, which scores the student's samples on the same requests (the same images and image tokens) by
    its prompt logprobs. An engine teacher needs rollout.temperature=1 (engines score the raw distribution) and the
    plain rollout; in this process, one training device (a teacher at teacher_url runs at any dp)."""
    teacher_url: str = ""
    """teacher_engine=sglang-server: the URL of an SGLang server that serves the teacher (e.g. http://10.0.0.7:30000;
    it must run with SGLANG_RETURN_ORIGINAL_LOGPROB=1, checked at connect), as verl's and slime's teacher servers run
    on devices of their own; empty = vlmrl launches one on this machine (on rollout.server.host)."""
    teacher_gpu_memory_utilization: float = 0.3
    """An engine teacher's share of GPU memory (vllm gpu_memory_utilization, sglang mem_fraction_static), beside
    rollout.gpu_memory_utilization of the student's engine and the actor's memory. Not used on CPU."""
    engine_check_samples: int = 4
    """An engine teacher: at the first step, this many of the student's samples are also scored by the teacher
    loaded in the trainer (the alignment tool's trainer side), and the run stops with one error line unless the two
    agree within the teacher dtype's band (logged as distill/first_step_engine_gap); 0 = no check (a teacher too
    large to load in the trainer's process)."""
    mode: str = "advantage"
    """advantage: -(log p_student - log p_teacher) of each sampled token is a per-token reward, summed with
    `discount` into a per-token advantage (Thinking Machines' On-Policy Distillation; verl's use_policy_gradient);
    loss: the `estimator` of KL(student || teacher) over the loss mask, times `coef`, added to the policy loss
    (GKD's supervised form; verl's default)."""
    estimator: str = "k1"
    """The loss mode's estimator: k1 (log p_s - log p_t) or k3 (p_t/p_s - log(p_t/p_s) - 1, verl's low_var_kl), the
    reverse KL of the sampled token; or forward_kl_topk (verl's loss_mode of that name): sum over the teacher's
    `topk` most likely tokens at each position of p_t (log p_t - log p_s), the forward KL on the teacher's top-k
    support. The advantage mode is k1 (its per-token reward)."""
    topk: int = 32
    """forward_kl_topk: how many of the teacher's most likely tokens per position (verl's distillation_loss.topk;
    its example: 32). An engine teacher returns them with its prompt logprobs (vLLM prompt_logprobs=k, SGLang
    top_logprobs_num), the trainer-side teacher from its logits."""
    discount: float = 0.0
    """advantage: the discount of the future tokens' rewards in a token's advantage, in [0, 1]; 0 = each token's own
    reverse KL (Thinking Machines' default)."""
    coef: float = 1.0
    """advantage: the weight of the distillation advantage (Thinking Machines' kl_penalty_coef); loss: the weight of
    the distillation loss (verl's distillation_loss_coef)."""
    reward_weight: float = 1.0
    """The weight of the reward's advantage (algorithm.adv_estimator's) beside the distillation's; 0 = pure
    distillation (the reward is still computed and logged)."""
    loss_max_clamp: float | None = None
    """verl's distillation_loss.loss_max_clamp: each token's distillation loss (k1, k3 or the top-k forward KL; in
    the advantage mode the k1 it negates) clamped to [-c, c] before use; a clamped token passes no gradient. null =
    off (verl's default; its examples set 10)."""
    log_prob_min_clamp: float | None = None
    """verl's distillation_loss.log_prob_min_clamp, read by estimator=forward_kl_topk (as in verl): both sides' top-k
    logprobs clamped from below before the sum. null = off (verl's default; its examples set -10)."""

    @property
    def enabled(self) -> bool:
        return bool(self.teacher)

    @property
    def served_by_url(self) -> bool:
        """The teacher is a server the user runs (teacher_engine=sglang-server with teacher_url): on devices of its
        own, whatever the trainer's layout."""
        return self.teacher_engine == "sglang-server" and bool(self.teacher_url)

    def problems(self) -> list[str]:
        """What is wrong, each with what to change; empty when valid (or off)."""
        if not self.enabled:
            return []
        out = []
        if self.mode not in DISTILL_MODES:
            out.append(f"algorithm.distill.mode={self.mode!r} is not one of {list(DISTILL_MODES)}")
        if self.estimator not in DISTILL_ESTIMATORS:
            out.append(f"algorithm.distill.estimator={self.estimator!r} is not one of {list(DISTILL_ESTIMATORS)}")
        elif self.mode == "advantage" and self.estimator != "k1":
            out.append(f"algorithm.distill.estimator={self.estimator} applies to mode=loss; the advantage mode's "
                       "per-token reward is k1: set algorithm.distill.mode=loss or estimator=k1")
        if self.teacher_dtype not in ("auto", "float32", "bfloat16"):
            out.append(f"algorithm.distill.teacher_dtype={self.teacher_dtype!r} is not auto, float32 or bfloat16")
        if not 0.0 <= self.discount <= 1.0:
            out.append(f"algorithm.distill.discount={self.discount} must be in [0, 1] (0 = each token's own KL)")
        if self.mode == "loss" and self.discount:
            out.append(f"algorithm.distill.discount={self.discount} applies to mode=advantage: set it to 0 or "
                       "mode=advantage")
        if self.coef < 0 or self.reward_weight < 0:
            out.append(f"algorithm.distill.coef={self.coef} and reward_weight={self.reward_weight} must be >= 0")
        if self.coef == 0 and self.reward_weight == 0:
            out.append("algorithm.distill.coef=0 and reward_weight=0 leave nothing to learn: raise one of them")
        if self.loss_max_clamp is not None and self.loss_max_clamp <= 0:
            out.append(f"algorithm.distill.loss_max_clamp={self.loss_max_clamp} must be > 0 (null = off; verl's "
                       "examples: 10)")
        if self.log_prob_min_clamp is not None and self.log_prob_min_clamp >= 0:
            out.append(f"algorithm.distill.log_prob_min_clamp={self.log_prob_min_clamp} must be < 0 (null = off; "
                       "verl's examples: -10)")
        elif self.log_prob_min_clamp is not None and self.estimator != "forward_kl_topk":
            out.append(f"algorithm.distill.log_prob_min_clamp={self.log_prob_min_clamp} is read by "
                       f"estimator=forward_kl_topk only (as in verl), not {self.estimator}: set it to null or use "
                       "estimator=forward_kl_topk")
        if self.estimator == "forward_kl_topk" and self.topk < 1:
            out.append(f"algorithm.distill.topk={self.topk} must be >= 1 for estimator=forward_kl_topk (verl's "
                       "example: 32)")
        if self.teacher_engine not in TEACHER_ENGINES:
            out.append(f"algorithm.distill.teacher_engine={self.teacher_engine!r} is not one of "
                       f"{list(TEACHER_ENGINES)}")
        package = TEACHER_ENGINE_PACKAGES.get(self.teacher_engine)
        if self.teacher_url and self.teacher_engine != "sglang-server":
            out.append(f"algorithm.distill.teacher_url={self.teacher_url!r} is read by teacher_engine=sglang-server, "
                       f"not {self.teacher_engine}: set algorithm.distill.teacher_engine=sglang-server or clear the "
                       "URL")
        elif self.teacher_url and not self.teacher_url.startswith(("http://", "https://")):
            out.append(f"algorithm.distill.teacher_url={self.teacher_url!r} must start with http:// or https://")
        if package and not self.served_by_url and importlib.util.find_spec(package) is None:
            out.append(f"algorithm.distill.teacher_engine={self.teacher_engine} needs {package}, which is not "
                       "installed in this environment: install it or set algorithm.distill.teacher_engine=trainer")
        if not 0 < self.teacher_gpu_memory_utilization <= 1:
            out.append(f"algorithm.distill.teacher_gpu_memory_utilization={self.teacher_gpu_memory_utilization} must "
                       "be in (0, 1]")
        if self.engine_check_samples < 0:
            out.append(f"algorithm.distill.engine_check_samples={self.engine_check_samples} must be >= 0 (0 = no "
                       "check)")
        return out

    def run_problems(self, *, world_size: int, multi_turn: bool, temperature: float) -> list[str]:
        """What an engine teacher does not run with, from the other sections: its scores are the engine's raw
        logprobs (the student's are of softmax(logits / rollout.temperature)), of a prompt plus the sampled tokens
        (a multi-turn trajectory also holds tool tokens and images of later turns), in the driver's process (at
        dp > 1 the devices are the training workers')."""
        if not self.enabled:
            return []
        if self.teacher_engine == "trainer":
            return []
        out = []
        key = f"algorithm.distill.teacher_engine={self.teacher_engine}"
        if temperature != 1.0:
            out.append(f"{key} scores the raw model distribution, the student's logprobs are of rollout.temperature="
                       f"{temperature}: set rollout.temperature=1.0 or algorithm.distill.teacher_engine=trainer")
        if multi_turn:
            out.append(f"{key} scores a prompt plus the sampled tokens; agent.enable trajectories hold tool turns: "
                       "set algorithm.distill.teacher_engine=trainer or agent.enable=false")
        if world_size > 1 and not self.served_by_url:
            out.append(f"{key} runs in the driver's process, and at trainer.n_gpus_per_node x nnodes = {world_size} "
                       "the devices are the training workers': set algorithm.distill.teacher_engine=trainer (sharded "
                       "like the reference), serve the teacher on devices of its own (teacher_engine=sglang-server "
                       "with algorithm.distill.teacher_url) or train on one device")
        return out


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    """Advantage estimator: grpo, rloo, reinforce_plus_plus or reinforce_plus_plus_baseline."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide group-centred rewards by the group std (GRPO); false = mean-centred only (Dr. GRPO). grpo only."""
    rollout_correction: str = "off"
    """Correct for the gap between the engine's and the trainer's logprobs (ratio = trainer / engine probability):
    off, token_tis (token weights, truncated at a cap), token_icepop (IcePop: token weights, 0 outside a band),
    seq_mis (Seq-MIS: sequences whose ratio leaves a band are taken out of the loss, the rest weighted by their
    ratio) or seq_rs (the same rejection, kept sequences weigh 1; or on the geometric mean: Geo-RS); bypass (verl's
    bypass mode, its ppo_is_bypass preset: the engine's logprobs are the PPO anchor, old = behaviour policy, so the
    clipped ratio itself corrects, with no recomputed old logprobs and no extra weights: one forward pass fewer a
    step). Turn it on when rollout/logprob_abs_diff is not small (bf16 or quantised engine, long responses) or the
    batches are stale (trainer.async_rollout). Needs rollout.temperature=1."""
    rollout_correction_token_cap: float = 2.0
    """token_tis: the largest importance weight (verl's 2.0)."""
    rollout_correction_token_low: float = 0.5
    """token_icepop: a token whose ratio is below this gets weight 0 (<= 1; IcePop's and verl's 0.5)."""
    rollout_correction_token_high: float = 5.0
    """token_icepop: a token whose ratio is above this gets weight 0 (>= 1; IcePop's and verl's 5.0)."""
    rollout_correction_seq_low: float = 0.5
    """seq_mis / seq_rs: lower bound of the sequence ratio band (<= 1; inclusive)."""
    rollout_correction_seq_high: float = 2.0
    """seq_mis / seq_rs: upper bound of the sequence ratio band (>= 1; inclusive)."""
    rollout_correction_seq_ratio: str = "product"
    """seq_rs: the sequence ratio is the product of token ratios (product) or their geometric mean (geometric,
    length-normalised: use a band like [0.999, 1.001]). seq_mis takes the product (its weight)."""
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
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation from a teacher model (off while distill.teacher is empty)."""

    def __post_init__(self) -> None:
        # yaml reads `off` (and false / no) as the boolean False, which reaches a str field as "False"
        if self.rollout_correction in ("False", "false"):
            self.rollout_correction = "off"

    def problems(self) -> list[str]:
        """What is wrong, each with what to change; empty when valid."""
        out = []
        if self.adv_estimator not in ADV_ESTIMATORS:
            out.append(f"algorithm.adv_estimator={self.adv_estimator!r} is not one of {list(ADV_ESTIMATORS)}")
        elif self.adv_estimator != "grpo" and not self.norm_adv_by_std_in_grpo:  # compute_advantages would raise
            out.append(f"algorithm.norm_adv_by_std_in_grpo=false (Dr. GRPO) applies to adv_estimator=grpo only, not "
                       f"{self.adv_estimator}: set it to true or use adv_estimator=grpo")
        if self.rollout_correction not in ROLLOUT_CORRECTIONS:
            out.append(f"algorithm.rollout_correction={self.rollout_correction!r} is not one of "
                       f"{list(ROLLOUT_CORRECTIONS)}")
        if self.rollout_correction_seq_ratio not in SEQ_RATIOS:
            out.append(f"algorithm.rollout_correction_seq_ratio={self.rollout_correction_seq_ratio!r} is not one of "
                       f"{list(SEQ_RATIOS)}")
        if not self.rollout_correction_token_cap > 0:
            out.append(f"algorithm.rollout_correction_token_cap={self.rollout_correction_token_cap} must be > 0 (2.0)")
        if self.rollout_correction == "seq_mis" and self.rollout_correction_seq_ratio != "product":
            out.append("algorithm.rollout_correction=seq_mis weighs each kept sequence by the product of its token "
                       "ratios: for a band on their geometric mean (Geo-RS, kept sequences weigh 1) set "
                       "algorithm.rollout_correction=seq_rs, or set rollout_correction_seq_ratio=product")
        if not 0 < self.rollout_correction_seq_low <= 1.0 <= self.rollout_correction_seq_high:
            out.append(f"algorithm.rollout_correction_seq_low/high = {self.rollout_correction_seq_low}/"
                       f"{self.rollout_correction_seq_high} must satisfy 0 < low <= 1 <= high (e.g. 0.5 and 2.0)")
        if not 0 < self.rollout_correction_token_low <= 1.0 <= self.rollout_correction_token_high:
            out.append(f"algorithm.rollout_correction_token_low/high = {self.rollout_correction_token_low}/"
                       f"{self.rollout_correction_token_high} must satisfy 0 < low <= 1 <= high (IcePop: 0.5 and 5.0)")
        if self.dynamic_sampling_max_extra_draws < 0:
            out.append(f"algorithm.dynamic_sampling_max_extra_draws={self.dynamic_sampling_max_extra_draws} must be "
                       ">= 0")
        if self.overlong_buffer_len < 0:
            out.append(f"algorithm.overlong_buffer_len={self.overlong_buffer_len} must be >= 0 (0 = off)")
        if self.overlong_penalty_factor < 0:
            out.append(f"algorithm.overlong_penalty_factor={self.overlong_penalty_factor} must be >= 0 (DAPO: 1.0)")
        return out + self.distill.problems()
