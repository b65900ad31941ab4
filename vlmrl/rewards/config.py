"""Reward configuration: which function scores responses and how it runs (the run config's `reward` section), and
the judge model that may score them too (`reward.judge`, `vlmrl.rewards.judge`; docs/judge.md)."""

from __future__ import annotations

import importlib.util
import math
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmrl.rollout.config import ServerConfig, SGLangConfig, VLLMConfig

JUDGE_MODES = ("generate", "logprobs")
JUDGE_ENGINES = {"sglang": "sglang", "vllm": "vllm"}
"""Engines vlmrl can launch a judge server with -> the package each needs."""
TEMPLATE_FIELDS = ("question", "response", "ground_truth", "data_source", "extra_info")
"""The names a judge template may use (`{extra_info[key]}` reads one entry of the row's extra_info)."""
NO_RULE = "none"
"""reward.function value for no rule reward (every rule score 0): a judge-only reward."""


@dataclass
class JudgeServerConfig:
    """The judge server vlmrl launches when reward.judge.url is empty: an OpenAI-compatible vLLM or SGLang server,
    on this machine, for the run's whole life. It starts from the engines' own option sections (those of
    rollout.vllm, rollout.sglang and rollout.server), so it runs as the rollout engines do, the model family's
    settings included."""

    model_path: str = ""
    """Model the launched judge serves: a HF folder, a hub id, or an embedded name (`tiny`)."""
    engine: str = "sglang"
    """sglang (`python -m sglang.launch_server`, options in `sglang`) or vllm (`python -m
    vllm.entrypoints.openai.api_server`, options in `vllm`)."""
    device: str = "auto"
    """auto (cuda when this process sees a GPU, else cpu), cpu or cuda."""
    cuda_visible_devices: str = ""
    """CUDA_VISIBLE_DEVICES of the judge server (e.g. "1" keeps it off the actor's GPU 0); empty = this process's."""
    dtype: str = "auto"
    """auto (bfloat16 on a GPU; on CPU float32, or the family's only CPU dtype: Qwen3.5 bfloat16), float32, bfloat16
    or float16."""
    max_model_len: int = 4096
    """Longest judge request (template + images + response) plus its reply, in tokens."""
    gpu_memory_utilization: float = 0.8
    """Fraction of its GPU(s) the judge server may take (vLLM gpu_memory_utilization, SGLang mem_fraction_static);
    lower it when the judge shares a GPU with training."""
    start_timeout_s: float = 600.0
    """The server must answer /health within this after launch."""
    http: ServerConfig = field(default_factory=ServerConfig)
    """Where the judge server binds (host, port) and writes its output (log_file); its url is not used: a running
    judge server is reward.judge.url."""
    sglang: SGLangConfig = field(default_factory=SGLangConfig)
    """The SGLang judge server's options, as rollout.sglang's (engine_kwargs: extra server flags, {"tp_size": 2} ->
    --tp-size 2)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The vLLM judge server's options, as rollout.vllm's (engine_kwargs: extra server flags; the judge never sleeps,
    so the sleep options change nothing)."""

    def problems(self) -> list[str]:
        out = []
        if self.engine not in JUDGE_ENGINES:
            out.append(f"reward.judge.server.engine={self.engine!r} must be one of {list(JUDGE_ENGINES)}")
        elif importlib.util.find_spec(JUDGE_ENGINES[self.engine]) is None:
            out.append(f"reward.judge.server.engine={self.engine} needs {JUDGE_ENGINES[self.engine]}, which is not "
                       "installed here: install it, pick the other engine, or give a running server as "
                       "reward.judge.url")
        else:
            out += getattr(self, self.engine).problems(f"reward.judge.server.{self.engine}")
        if self.http.url:
            out.append(f"reward.judge.server.http.url={self.http.url!r}: a running judge server is given as "
                       "reward.judge.url (reward.judge.server launches one)")
        out += self.http.problems("reward.judge.server.http")
        if self.device not in ("auto", "cpu", "cuda"):
            out.append(f"reward.judge.server.device={self.device!r} must be auto, cpu or cuda")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            out.append(f"reward.judge.server.dtype={self.dtype!r} must be auto, float32, bfloat16 or float16")
        if self.max_model_len < 1:
            out.append(f"reward.judge.server.max_model_len={self.max_model_len} must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            out.append(f"reward.judge.server.gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.start_timeout_s <= 0:
            out.append(f"reward.judge.server.start_timeout_s={self.start_timeout_s} must be > 0")
        return out


@dataclass
class JudgeConfig:
    """A judge model that scores every response through the OpenAI chat API (docs/judge.md). Its score, in [0, 1],
    is combined with the rule reward (reward.function): reward = (1 - weight) * rule + weight * judge."""

    enable: bool = False
    """Score responses with the judge too."""
    url: str = ""
    """A running OpenAI-compatible server (vLLM, SGLang, or any), e.g. http://10.0.0.5:8000 (a trailing /v1 is
    fine); empty = vlmrl launches reward.judge.server.model_path. Checked to answer before training starts."""
    model: str = ""
    """Model name sent with every request; empty = the first model the server lists at /v1/models."""
    api_key_env: str = ""
    """Name of the environment variable holding the server's API key (sent as a Bearer token); empty = none.
    The key itself never goes into the config (which is saved with every run)."""
    mode: str = "generate"
    """generate: the judge writes a verdict and score_pattern reads the score from it (GenRM). logprobs: the judge's
    first reply token is read as a distribution over `choices`; the score is their probability-weighted value
    (a DisRM-like yes/no judge, one token per request)."""
    template: str = ""
    """The user message, a Python format string over {question}, {response}, {ground_truth}, {data_source} and
    {extra_info[key]} (write {{ and }} for literal braces); empty = the mode's built-in template (docs/judge.md)."""
    template_file: str = ""
    """A text file holding the template instead (not both)."""
    system_prompt: str = ""
    """A system message before the template; empty = none."""
    question_key: str = "question"
    """The extra_info entry {question} reads (verl's and vlmrl's data put the question text there)."""
    images: bool = True
    """Send the row's images to the judge (as PNG data URLs, before the template's text)."""
    video_frames: int = 4
    """Frames of each of the row's videos sent as images, evenly spaced; 0 = none."""
    score_pattern: str = r"\[\[\s*([^\[\]]+?)\s*\]\]"
    """generate mode: a regular expression with one group; its LAST match in the judge's reply is the score: one of
    `choices` (case-insensitive), else a number mapped from score_range to [0, 1]. The default reads `[[7]]`."""
    score_range: list[float] = field(default_factory=lambda: [0.0, 10.0])
    """generate mode: [low, high] of a numeric score (low -> 0, high -> 1); a number outside it fails the sample."""
    choices: dict[str, float] = field(default_factory=lambda: {"Yes": 1.0, "No": 0.0})
    """Verdict words -> their score in [0, 1]: the first-token choices of logprobs mode; words score_pattern may
    capture in generate mode."""
    top_logprobs: int = 20
    """logprobs mode: alternatives returned for the first token, among which the choices are looked up."""
    constrain: bool = True
    """logprobs mode: add a logit bias of +100 to each choice's token, so the first token is a choice whatever the
    judge would have said (their ratio is unchanged). Needs the judge's tokenizer (reward.judge.tokenizer) and a
    server that returns logprobs after the bias (SGLang does; vLLM with --logprobs-mode processed_logprobs, which
    vlmrl sets on the vLLM server it launches)."""
    tokenizer: str = ""
    """The judge model's tokenizer (folder or hub id) for `constrain`; empty = reward.judge.server.model_path."""
    min_choice_mass: float = 0.5
    """logprobs mode: the choices must hold at least this share of the first token's probability among the returned
    alternatives, else the judge did not answer with a choice and the sample fails."""
    max_tokens: int = 512
    """generate mode: longest verdict in tokens (logprobs mode asks for 1)."""
    temperature: float = 0.0
    """Judge sampling temperature; 0 = greedy (deterministic, what the cache assumes)."""
    seed: int = 0
    """Seed sent with every request (and given to a launched server)."""
    extra_body: dict[str, Any] = field(default_factory=dict)
    """Extra request fields sent as they are, e.g. {"regex": "..."} (SGLang), {"structured_outputs": {...}} (vLLM),
    {"chat_template_kwargs": {"enable_thinking": false}}."""
    weight: float = 1.0
    """reward = (1 - weight) * rule + weight * judge: 1 = the judge alone (the rule reward's parts are still logged);
    0.5 = an even mix."""
    max_concurrency: int = 16
    """Requests in flight at once (a batch is sent as concurrent requests, each distinct request once)."""
    timeout_s: float = 60.0
    """Most seconds one attempt of a request may take, its reply read in full (a reply still arriving then is cut and
    counted as a timeout, then retried as one)."""
    max_retries: int = 2
    """Retries of a request after a connection error, a timeout or HTTP 429/5xx, waiting retry_backoff_s, then
    twice that, ...; a request still failing fails its samples (counted, never a silent 0)."""
    retry_backoff_s: float = 1.0
    """The first wait before a retry (doubled for each next one)."""
    cache: bool = True
    """Keep every reply in memory, keyed by a hash of the request (messages with image hashes, model, sampling):
    a response judged once is not sent again (GRPO repeats short answers often)."""
    cache_file: str = ""
    """A JSON file the cache is loaded from at start and written to (atomically) after each batch that added
    replies, so a resumed run or a rerun asks nothing twice; empty = memory only."""
    server: JudgeServerConfig = field(default_factory=JudgeServerConfig)
    """The judge server vlmrl launches when reward.judge.url is empty."""

    def problems(self) -> list[str]:
        """What is wrong, each with what to change; empty when valid (checked only with reward.judge.enable)."""
        out = []
        if bool(self.url) == bool(self.server.model_path):
            out.append("reward.judge needs exactly one of reward.judge.url (a running server) and "
                       "reward.judge.server.model_path (a model vlmrl launches a server for)")
        if self.url and not self.url.startswith(("http://", "https://")):
            out.append(f"reward.judge.url={self.url!r} must start with http:// or https://")
        if not self.url and self.server.model_path:
            out += self.server.problems()
        if self.mode not in JUDGE_MODES:
            out.append(f"reward.judge.mode={self.mode!r} must be one of {list(JUDGE_MODES)}")
        out += self._template_problems()
        if not self.choices and self.mode == "logprobs":
            out.append("reward.judge.choices is empty: logprobs mode scores the first token over these words "
                       '(e.g. {"Yes": 1.0, "No": 0.0})')
        for word, value in self.choices.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and 0 <= value <= 1):
                out.append(f"reward.judge.choices[{word!r}]={value!r} must be a number in [0, 1]")
        if self.mode == "generate":
            try:
                groups = re.compile(self.score_pattern).groups
            except re.error as err:
                groups = -1
                out.append(f"reward.judge.score_pattern={self.score_pattern!r} is not a regular expression ({err})")
            if groups not in (-1, 1):
                out.append(f"reward.judge.score_pattern={self.score_pattern!r} has {groups} groups: it needs "
                           "exactly one, the score (use (?:...) for the others)")
        if len(self.score_range) != 2 or not self.score_range[0] < self.score_range[1]:
            out.append(f"reward.judge.score_range={list(self.score_range)} must be [low, high] with low < high")
        if self.mode == "logprobs" and self.constrain and not (self.tokenizer or self.server.model_path):
            out.append("reward.judge.constrain=true needs the judge's tokenizer to find the choices' token ids: set "
                       "reward.judge.tokenizer (a folder or hub id), or reward.judge.constrain=false")
        if not 0 <= self.weight <= 1:
            out.append(f"reward.judge.weight={self.weight} must be in [0, 1] (reward = (1 - weight) * rule + "
                       "weight * judge)")
        if not 0 < self.min_choice_mass <= 1:
            out.append(f"reward.judge.min_choice_mass={self.min_choice_mass} must be in (0, 1]")
        for name in ("top_logprobs", "max_tokens", "max_concurrency"):
            if getattr(self, name) < 1:
                out.append(f"reward.judge.{name}={getattr(self, name)} must be >= 1")
        for name in ("max_retries", "video_frames"):
            if getattr(self, name) < 0:
                out.append(f"reward.judge.{name}={getattr(self, name)} must be >= 0")
        if self.timeout_s <= 0:
            out.append(f"reward.judge.timeout_s={self.timeout_s} must be > 0: every judge request has a deadline")
        if self.retry_backoff_s < 0:
            out.append(f"reward.judge.retry_backoff_s={self.retry_backoff_s} must be >= 0")
        if self.temperature < 0:
            out.append(f"reward.judge.temperature={self.temperature} must be >= 0 (0 = greedy)")
        return out

    def _template_problems(self) -> list[str]:
        if self.template and self.template_file:
            return ["set reward.judge.template or reward.judge.template_file, not both"]
        if self.template_file and not Path(self.template_file).expanduser().is_file():
            return [f"reward.judge.template_file={self.template_file!r} does not exist"]
        text = self.template_text()
        try:
            names = {name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(text) if name}
        except ValueError as err:
            return [f"reward.judge template is not a valid format string ({err}): write {{{{ and }}}} for literal "
                    "braces"]
        unknown = sorted(names - set(TEMPLATE_FIELDS))
        if unknown:
            return [f"reward.judge template uses {unknown}: it may use only {list(TEMPLATE_FIELDS)} "
                    "({extra_info[key]} for one entry of the row's extra_info)"]
        if "response" not in names:
            return ["reward.judge template never shows the judge the {response} it is to score"]
        return []

    def template_text(self) -> str:
        """The user message template in use: reward.judge.template, the file's text, or the mode's built-in."""
        if self.template:
            return self.template
        if self.template_file:
            return Path(self.template_file).expanduser().read_text(encoding="utf-8")
        return DEFAULT_TEMPLATES.get(self.mode, DEFAULT_TEMPLATES["generate"])


DEFAULT_TEMPLATES = {
    "generate": (
        "You are grading an answer to a question about the image(s) above.\n\n"
        "Question: {question}\nReference answer: {ground_truth}\nAnswer to grade: {response}\n\n"
        "Judge whether the answer is correct and complete, given the image(s) and the reference. Explain briefly, "
        "then give your rating from 0 (wrong) to 10 (fully correct) on the last line, formatted as Rating: [[N]]."),
    "logprobs": (
        "You are grading an answer to a question about the image(s) above.\n\n"
        "Question: {question}\nReference answer: {ground_truth}\nAnswer to grade: {response}\n\n"
        "Is the answer correct? Reply with one word: Yes or No."),
}
"""The built-in templates (reward.judge.template empty); the logprobs one asks for the default choices."""


@dataclass
class RewardConfig:
    function: str = ""
    """Reward: empty = chosen per row by data_source (geo3k, synthetic), a built-in name, `path/to/file.py:fn`, or
    none (no rule reward: every rule score is 0; for a judge-only reward with reward.judge.weight=1)."""
    timeout_s: float | None = 10.0
    """Most seconds the reward function may take on one sample. A sample that takes longer is stopped (its worker
    process is killed and replaced), scores 0 and is flagged reward_failed=1 and reward_timeout=1 (metrics
    reward/timeouts, val/reward_timeouts); the run goes on. With a limit the function runs in reward.num_workers worker
    processes, so it must be defined at module level (built-ins, `path/to/file.py:fn` and `package.module:fn` are),
    and module-level state in it is per worker. 0 or null: no limit, scored in the trainer's process."""
    num_workers: int = 1
    """Worker processes scoring under reward.timeout_s; each gets one contiguous share of every batch. More
    score a batch in parallel (slow graders such as sympy-based ones)."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """A judge model scoring every response too (docs/judge.md)."""

    def problems(self) -> list[str]:
        """What is wrong, each with what to change; empty when valid."""
        out = []
        if self.timeout_s is not None and self.timeout_s < 0:
            out.append(f"reward.timeout_s={self.timeout_s} must be >= 0 (0 or null = no limit, scored in this process)")
        if self.num_workers < 1:
            out.append(f"reward.num_workers={self.num_workers} must be >= 1")
        if self.function.strip() == NO_RULE and not (self.judge.enable and self.judge.weight == 1):
            out.append("reward.function=none scores every sample 0: it is for a judge-only reward (set "
                       "reward.judge.enable=true and reward.judge.weight=1), else pick a reward function")
        if self.judge.enable:
            out += self.judge.problems()
        return out
