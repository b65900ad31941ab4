"""The judge reward (reward.judge): a served model scores every response through the OpenAI chat API, and its score is
combined with the rule reward. The user's guide, with every rule below, is docs/judge.md.

    judge = start_judge(config.reward.judge)        # launches its server or checks the given URL answers
    verdicts = judge.score(requests, responses, n)  # one Verdict per response, request-major
    values, parts = combine(rule_values, rule_parts, verdicts, n, weight)
    judge.close()                                   # ends the server it launched; a closed judge scores no more

A run's judge is one of its parts: its reward (`vlmrl.rewards.scoring.RewardScorer`) starts it with the run's other
parts and closes it with them, so two runs in one process never share one.

A request is one chat: an optional system message, then one user message holding the row's images (and frames of
its videos) as PNG data URLs followed by the template rendered with the row and the response. A batch goes out as
concurrent requests (reward.judge.max_concurrency), each distinct request once; replies are cached by a hash of the
request (its messages with image hashes in place of the pixels, the model, the sampling), in memory and optionally
in a JSON file. Every request has a timeout and is retried with backoff after connection errors, timeouts and
HTTP 429/5xx.

Scores (in [0, 1]), by reward.judge.mode:
  generate   the LAST match of score_pattern in the reply: one of `choices`, else a number mapped from score_range.
  logprobs   the first reply token's distribution over `choices`: sum(p * value) / sum(p), the choices holding at
             least min_choice_mass of its probability (with `constrain`, a logit bias makes the first token a choice).

A sample whose request fails after its retries, or whose reply does not give a score, is a FAILED sample, never a
silent 0: it is flagged `judge_failed = 1` and `reward_failed = 1` (counted in reward/failures), and its judge part is
the mean judge score of its group (the n responses to its prompt; of the batch when none of its group was judged;
0 when nothing was), so it gets no advantage from the judge: its reward moves only with the rule part.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from vlmrl.rewards.base import FAILED_KEY
from vlmrl.rewards.config import JudgeConfig
from vlmrl.rewards.judge_prompt import render_text, visual_parts

if TYPE_CHECKING:
    from vlmrl.types import RolloutRequest
    from vlmrl.utils.servers import LaunchedServer

logger = logging.getLogger(__name__)

JUDGE_KEY = "judge"
"""Reward part: the judge's score in [0, 1] (on a failed sample, the fill it got: see the module docstring)."""
JUDGE_FAILED_KEY = "judge_failed"
"""Reward part set to 1.0 on a sample the judge failed to score (also flagged reward_failed): its mean is the
judge's failure rate."""
JUDGE_CACHED_KEY = "judge_cached"
"""Reward part set to 1.0 on a sample whose judge reply came from the cache (no request sent)."""
RULE_KEY = "rule"
"""Reward part: the rule reward's score (reward.function), before the weighting."""
LOGIT_BIAS = 100
"""What `constrain` adds to each choice token's logit (the most the OpenAI API allows)."""
CACHE_VERSION = 1


class JudgeError(RuntimeError):
    """The judge cannot be used as configured (unreachable endpoint, unusable replies): raised at start."""


class JudgeRequestError(RuntimeError):
    """A request failed (after its retries, when retrying could help): its samples fail."""


class JudgeParseError(ValueError):
    """A reply gave no score: its samples fail."""


@dataclass
class Verdict:
    """The judge's score of one response, or why there is none."""

    score: float | None
    """In [0, 1]; None when the judge failed on this sample."""
    error: str = ""
    """Why there is no score: the request's failure or the reply that did not parse."""
    cached: bool = False
    """The reply came from the cache."""


@dataclass
class JudgeStats:
    """What the judge did since it started (tests and logs read it)."""

    requests: int = 0
    """Distinct requests sent (each may take several attempts)."""
    attempts: int = 0
    """HTTP attempts, retries included."""
    cache_hits: int = 0
    """Samples answered from the cache."""
    failures: int = 0
    """Samples the judge failed to score."""
    timeouts: int = 0
    """Attempts ended at reward.judge.timeout_s (no reply, or one still arriving then)."""


# ---------------------------------------------------------------------------------------------------- scoring rules


def parse_rating(reply: str, pattern: str, choices: dict[str, float], score_range: Sequence[float]) -> float:
    r"""generate mode's score of a reply: the LAST match of `pattern` (a judge may quote the format before it gives
    its own rating), one of `choices` (case-insensitive), else a number mapped from `score_range` to [0, 1].

    >>> parse_rating("Partly right. Rating: [[7]]", r"\[\[\s*([^\[\]]+?)\s*\]\]", {}, [0, 10])
    0.7
    >>> parse_rating(r"Verdict: \boxed{True}", r"\\boxed\{(\w+)\}", {"True": 1.0, "False": 0.0}, [0, 1])
    1.0
    >>> parse_rating("It looks fine to me.", r"\[\[(.+?)\]\]", {}, [0, 10])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    vlmrl.rewards.judge.JudgeParseError: no match of score_pattern ... in the reply 'It looks fine to me.'
    """
    matches = re.findall(pattern, reply)
    if not matches:
        raise JudgeParseError(f"no match of score_pattern {pattern!r} in the reply {_clip(reply)!r}")
    found = str(matches[-1]).strip()
    lowered = {word.lower(): value for word, value in choices.items()}
    if found.lower() in lowered:
        return float(lowered[found.lower()])
    try:
        number = float(found)
    except ValueError:
        raise JudgeParseError(f"score_pattern captured {found!r}, which is neither a number nor one of the choices "
                              f"{sorted(choices)}") from None
    low, high = float(score_range[0]), float(score_range[1])
    if not (math.isfinite(number) and low <= number <= high):
        raise JudgeParseError(f"score {found} is outside score_range [{low:g}, {high:g}]")
    return (number - low) / (high - low)


def choice_score(alternatives: Sequence[tuple[str, float]], choices: dict[str, float], min_mass: float) -> float:
    """logprobs mode's score: the first token's alternatives (token text, logprob) read as a distribution over the
    choices (a token counts for a choice when its text, stripped, is the choice's word, case-insensitive):
    sum(p * value) / sum(p), the choices holding at least `min_mass` of the probability.

    >>> yes_no = {"Yes": 1.0, "No": 0.0}
    >>> choice_score([("Yes", math.log(0.6)), (" yes", math.log(0.1)), ("No", math.log(0.3))], yes_no, 0.5)
    0.7
    >>> choice_score([("Maybe", math.log(0.9)), ("No", math.log(0.05))], yes_no, 0.5)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    vlmrl.rewards.judge.JudgeParseError: the choices ['No', 'Yes'] hold 0.05 of the first token's probability ...
    """
    lowered = {word.lower(): float(value) for word, value in choices.items()}
    mass = weighted = 0.0
    for token, logprob in alternatives:
        value = lowered.get(token.strip().lower())
        if value is not None:
            p = math.exp(logprob)
            mass, weighted = mass + p, weighted + p * value
    if mass < min_mass or mass <= 0:
        top = [(token, round(math.exp(logprob), 3)) for token, logprob in alternatives[:5]]
        raise JudgeParseError(f"the choices {sorted(choices)} hold {mass:.3g} of the first token's probability "
                              f"(< min_choice_mass {min_mass:g}); its top alternatives: {top}")
    return weighted / mass


def combine(rule_values: Sequence[float], rule_parts: Sequence[dict[str, float]], verdicts: Sequence[Verdict],
            n: int, weight: float) -> tuple[list[float], list[dict[str, float]]]:
    """Each sample's reward = (1 - weight) * rule + weight * judge, and its parts: the rule's own, plus `rule`,
    `judge`, `judge_failed`, `judge_cached`, and `reward_failed` also set where the judge failed. A failed sample's
    judge part is the mean judge score of its group (request-major, n per group), else of the batch, else 0.

    >>> values, parts = combine([1.0, 0.0, 1.0, 0.0], [{"reward_failed": 0.0}] * 4,
    ...                         [Verdict(0.8), Verdict(0.2), Verdict(None, "timed out"), Verdict(0.6)], n=2, weight=0.5)
    >>> values
    [0.9, 0.1, 0.8, 0.3]
    >>> parts[2]
    {'reward_failed': 1.0, 'rule': 1.0, 'judge': 0.6, 'judge_failed': 1.0, 'judge_cached': 0.0}
    """
    if not len(rule_values) == len(rule_parts) == len(verdicts):
        raise ValueError(f"{len(rule_values)} rule scores, {len(rule_parts)} parts and {len(verdicts)} verdicts")
    judged = [v.score for v in verdicts if v.score is not None]
    batch_fill = sum(judged) / len(judged) if judged else 0.0
    values, parts = [], []
    for i, (rule, verdict) in enumerate(zip(rule_values, verdicts)):
        score = verdict.score
        if score is None:
            group = [v.score for v in verdicts[i // n * n:(i // n + 1) * n] if v.score is not None]
            score = sum(group) / len(group) if group else batch_fill
        failed = verdict.score is None
        values.append((1.0 - weight) * rule + weight * score)
        parts.append({**rule_parts[i], FAILED_KEY: max(rule_parts[i].get(FAILED_KEY, 0.0), float(failed)),
                      RULE_KEY: rule, JUDGE_KEY: score, JUDGE_FAILED_KEY: float(failed),
                      JUDGE_CACHED_KEY: float(verdict.cached)})
    return values, parts


# ---------------------------------------------------------------------------------------------------- requests


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _read_body(response: Any, deadline: float) -> str:
    """A streamed `requests` response's body, read as it arrives; TimeoutError once `deadline` (time.monotonic) has
    passed. Each read waits at most the time left: the socket's timeout is set to it before every read, so a reply
    sent a few bytes at a time cannot hold the call past the deadline (a per-read timeout alone lets it)."""
    from urllib3.exceptions import ReadTimeoutError

    raw, chunks = response.raw, []
    sock = getattr(raw.connection, "sock", None) if raw.connection is not None else None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the reply did not finish in time")
        if sock is not None:
            sock.settimeout(left)
        try:
            chunk = raw.read1(65536, decode_content=True)
        except ReadTimeoutError as err:  # urllib3's form of the socket's timeout
            raise TimeoutError("the reply did not finish in time") from err
        if not chunk:
            return b"".join(chunks).decode(response.encoding or "utf-8", errors="replace")
        chunks.append(chunk)


def base_url(url: str) -> str:
    """The server's base from reward.judge.url (a trailing slash or /v1 is dropped).

    >>> base_url("http://10.0.0.5:8000/v1/")
    'http://10.0.0.5:8000'
    """
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


# ---------------------------------------------------------------------------------------------------- the judge


class Judge:
    """A client of one judge endpoint: `check()` it answers, `score(requests, responses, n)` a batch, `close()`
    (safe to call twice; a closed judge refuses to score). With `server`, the launched server it owns (closed with
    it)."""

    def __init__(self, config: JudgeConfig, url: str | None = None, server: LaunchedServer | None = None):
        self.config = config
        self.server = server
        self.url = base_url(url or config.url)
        self.model = config.model
        self.template = config.template_text()
        self.stats = JudgeStats()
        self.logit_bias: dict[str, int] = {}
        self._cache: dict[str, dict[str, Any]] = self._load_cache() if config.cache else {}
        self._local = threading.local()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.closed = False
        self._loopback = urlparse(self.url).hostname in ("127.0.0.1", "localhost", "::1")
        self._api_key = ""
        if config.api_key_env:
            self._api_key = os.environ.get(config.api_key_env, "")
            if not self._api_key:
                raise JudgeError(f"reward.judge.api_key_env={config.api_key_env}: that environment variable is not "
                                 "set (it holds the judge server's API key)")

    # ---- start-up

    def check(self) -> None:
        """Fails fast (JudgeError naming the URL) unless the endpoint answers, serves the model and replies to a
        probe request in the form the mode reads; finds the model's name and the choices' tokens (constrain)."""
        import requests

        try:
            listed = self._session().get(f"{self.url}/v1/models", timeout=min(self.config.timeout_s, 30),
                                         headers=self._headers())
        except requests.RequestException as err:
            raise JudgeError(f"reward.judge: the judge endpoint {self.url} does not answer ({type(err).__name__}: "
                             f"{err}): start it, or fix reward.judge.url") from None
        if listed.status_code != 200:
            raise JudgeError(f"reward.judge: GET {self.url}/v1/models answered HTTP {listed.status_code}: "
                             f"{_clip(listed.text)} (is it an OpenAI-compatible server? is the API key right?)")
        served = [entry.get("id", "") for entry in listed.json().get("data", [])]
        if not self.model:
            if not served:
                raise JudgeError(f"reward.judge: {self.url} serves no model; set reward.judge.model")
            self.model = served[0]
        elif served and self.model not in served:
            raise JudgeError(f"reward.judge.model={self.model!r} is not served by {self.url} (it serves {served})")
        if self.config.mode == "logprobs" and self.config.constrain:
            self.logit_bias = choice_logit_bias(self.config.tokenizer or self.config.server.model_path,
                                                self.config.choices)
        probe = [{"role": "user", "content": "Reply with one word: Yes or No. Is 2 + 2 = 4?"}]
        try:
            reply = self._reply(self._post(self._body(probe)))
        except (JudgeRequestError, JudgeParseError) as err:
            raise JudgeError(f"reward.judge: a probe request to {self.url} failed: {err}") from None
        logger.info("judge: %s serves %s (%s mode); probe reply %r", self.url, self.model, self.config.mode,
                    _clip(reply.get("text", ""), 80))

    # ---- scoring

    def score(self, requests: Sequence[RolloutRequest], responses: Sequence[str], n: int) -> list[Verdict]:
        """One Verdict per response (request-major, n per request). Distinct requests go out concurrently, each
        once; cached ones not at all."""
        if self.closed:
            raise RuntimeError(f"the judge on {self.url} is closed (its run has ended): a run's judge scores only "
                               "while the run is open")
        if len(responses) != n * len(requests):
            raise ValueError(f"{len(responses)} responses for {len(requests)} requests x n={n}")
        keys, bodies = [], {}
        for r, request in enumerate(requests):
            visual, visual_keys = visual_parts(request, self.config)  # once per request: its n responses share it
            for response in responses[r * n:(r + 1) * n]:
                messages = self._messages(visual, render_text(self.template, request, response,
                                                              self.config.question_key))
                body = self._body(messages)
                key = self._key(body, visual_keys)
                keys.append(key)
                if key not in self._cache:
                    bodies[key] = body
        replies: dict[str, dict[str, Any] | Exception] = dict.fromkeys(keys)
        for key in keys:
            if key in self._cache:
                replies[key] = self._cache[key]
        if bodies:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.config.max_concurrency, thread_name_prefix="vlmrl-judge")
            futures = {key: self._pool.submit(self._ask, body) for key, body in bodies.items()}
            for key, future in futures.items():
                replies[key] = future.result()  # _ask returns its error instead of raising
        verdicts = []
        for key in keys:
            reply = replies[key]
            cached = key not in bodies
            if isinstance(reply, Exception):
                verdicts.append(Verdict(None, f"{type(reply).__name__}: {reply}"))
                continue
            try:
                verdicts.append(Verdict(self._score_of(reply), cached=cached))
            except JudgeParseError as err:
                verdicts.append(Verdict(None, f"JudgeParseError: {err}", cached=cached))
        self._remember({key: reply for key, reply in replies.items()
                        if key in bodies and not isinstance(reply, Exception)})
        self.stats.cache_hits += sum(v.cached for v in verdicts)
        self.stats.failures += sum(v.score is None for v in verdicts)
        self._log_failures(verdicts)
        return verdicts

    def _ask(self, body: dict[str, Any]) -> dict[str, Any] | Exception:
        """The reply of one request (`_reply`'s form), or the error that stopped it (after its retries)."""
        with self._lock:
            self.stats.requests += 1
        try:
            return self._reply(self._post(body))
        except (JudgeRequestError, JudgeParseError) as err:
            return err

    def _score_of(self, reply: dict[str, Any]) -> float:
        c = self.config
        if c.mode == "logprobs":
            return choice_score([tuple(pair) for pair in reply["alternatives"]], c.choices, c.min_choice_mass)
        return parse_rating(reply["text"], c.score_pattern, c.choices, c.score_range)

    # ---- the HTTP side

    def _messages(self, visual: list[dict], text: str) -> list[dict[str, Any]]:
        user: Any = [*visual, {"type": "text", "text": text}] if visual else text
        system = [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        return [*system, {"role": "user", "content": user}]

    def _body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        c = self.config
        body: dict[str, Any] = {"model": self.model, "messages": messages, "temperature": c.temperature,
                                "seed": c.seed}
        if c.mode == "logprobs":
            body.update(max_tokens=1, logprobs=True, top_logprobs=c.top_logprobs)
            if self.logit_bias:
                body["logit_bias"] = self.logit_bias
        else:
            body["max_tokens"] = c.max_tokens
        body.update(c.extra_body)
        return body

    def _key(self, body: dict[str, Any], visual_keys: list[str]) -> str:
        """A hash of what decides the reply: the body with each image's pixels replaced by its hash."""
        light = {**body, "messages": [
            {**m, "content": [p for p in m["content"] if p.get("type") != "image_url"]}
            if isinstance(m["content"], list) else m for m in body["messages"]]}
        text = json.dumps({"request": light, "images": visual_keys}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    def _session(self):
        import requests

        session = getattr(self._local, "session", None)
        if session is None:  # one per thread: a requests.Session is not thread-safe
            session = requests.Session()
            session.trust_env = not self._loopback  # no proxy between us and a server on this machine
            self._local.session = session
        return session

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/chat/completions, each attempt ended at reward.judge.timeout_s after it began (connecting and the
        reply's headers each wait at most that; the body is read under the attempt's deadline, so a reply that
        trickles in is cut there: `_read_body`), retried with backoff after connection errors,
        timeouts and HTTP 408/429/5xx; other HTTP errors are not retried (the request itself is wrong)."""
        import requests

        c = self.config
        delay, error = c.retry_backoff_s, ""
        for attempt in range(c.max_retries + 1):
            if attempt:
                time.sleep(delay)
                delay *= 2
            with self._lock:
                self.stats.attempts += 1
            deadline = time.monotonic() + c.timeout_s
            try:
                with self._session().post(f"{self.url}/v1/chat/completions", json=body, timeout=c.timeout_s,
                                          headers=self._headers(), stream=True) as response:
                    status, text = response.status_code, _read_body(response, deadline)
            except (requests.Timeout, TimeoutError):
                with self._lock:
                    self.stats.timeouts += 1
                error = f"no reply from {self.url} within reward.judge.timeout_s={c.timeout_s:g} s"
                continue
            except requests.ConnectionError as err:
                error = f"cannot reach {self.url} ({type(err).__name__}: {_clip(str(err), 200)})"
                continue
            if status == 200:
                try:
                    return json.loads(text)
                except ValueError:
                    raise JudgeRequestError(f"{self.url} answered HTTP 200 with no JSON: {_clip(text)!r}") from None
            error = f"HTTP {status} from {self.url}: {_clip(text)}"
            if status not in (408, 429) and status < 500:
                raise JudgeRequestError(error)
        raise JudgeRequestError(f"{error} (after {c.max_retries + 1} attempts)")

    def _reply(self, answer: dict[str, Any]) -> dict[str, Any]:
        """What the scoring reads of a chat completion (and the cache keeps): its text, and in logprobs mode the
        first token's alternatives as [token, logprob] pairs."""
        try:
            choice = answer["choices"][0]
            reply: dict[str, Any] = {"text": choice["message"].get("content") or "",
                                     "finish_reason": choice.get("finish_reason")}
            if self.config.mode == "logprobs":
                first = (choice.get("logprobs") or {}).get("content") or []
                if not first:
                    raise JudgeParseError(f"{self.url} returned no logprobs (logprobs mode needs a server that "
                                          "returns them with top_logprobs)")
                reply["alternatives"] = [[alt["token"], float(alt["logprob"])]
                                         for alt in first[0].get("top_logprobs") or []]
        except (KeyError, IndexError, TypeError, AttributeError) as err:
            raise JudgeParseError(f"not a chat completion ({type(err).__name__}: {err}): "
                                  f"{_clip(json.dumps(answer))}") from None
        return reply

    # ---- the cache

    def _load_cache(self) -> dict[str, dict[str, Any]]:
        path = self.config.cache_file
        if not path or not Path(path).expanduser().exists():
            return {}
        data = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("replies"),
                                                                                                   dict):
            raise JudgeError(f"reward.judge.cache_file={path} is not a judge cache (version {CACHE_VERSION}): "
                             "move it away or point the setting at another file")
        logger.info("judge: %d cached replies from %s", len(data["replies"]), path)
        return data["replies"]

    def _remember(self, new: dict[str, dict[str, Any]]) -> None:
        if not self.config.cache or not new:
            return
        self._cache.update(new)
        if self.config.cache_file:
            from vlmrl.atomic import write_text_atomically

            write_text_atomically(Path(self.config.cache_file).expanduser(),
                                  json.dumps({"version": CACHE_VERSION, "replies": self._cache}))

    def _log_failures(self, verdicts: Sequence[Verdict]) -> None:
        failed = [i for i, v in enumerate(verdicts) if v.score is None]
        if failed:
            logger.warning("judge failed on %d of %d samples: they are flagged %s and %s (counted in reward/failures) "
                           "and get their group's mean judge score. First one, sample %d: %s", len(failed),
                           len(verdicts), JUDGE_FAILED_KEY, FAILED_KEY, failed[0], verdicts[failed[0]].error)

    def close(self) -> None:
        """Stops the request threads and the server this judge launched (if any)."""
        self.closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self.server is not None:
            self.server.close()
            self.server = None


def choice_logit_bias(tokenizer_path: str, choices: dict[str, float]) -> dict[str, int]:
    """{token id: +LOGIT_BIAS} for each choice word, which must be one token of the judge's tokenizer."""
    from transformers import AutoTokenizer

    from vlmrl.models.tiny import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(tokenizer_path)))
    bias = {}
    for word in choices:
        ids = tokenizer.encode(word, add_special_tokens=False)
        if len(ids) != 1:
            raise JudgeError(f"reward.judge.choices: {word!r} is {len(ids)} tokens {ids} of the judge's tokenizer "
                             f"({tokenizer_path}); constrain needs one-token choices: pick other words or set "
                             "reward.judge.constrain=false")
        bias[str(ids[0])] = LOGIT_BIAS
    return bias


def start_judge(config: JudgeConfig) -> Judge:
    """A checked judge: on reward.judge.url, or on a server launched now (reward.judge.server). The caller owns it:
    its `close()` ends the server it launched."""
    server = None
    if not config.url:
        from vlmrl.rewards.judge_server import launch_judge_server

        server = launch_judge_server(config.server, seed=config.seed, top_logprobs=config.top_logprobs)
    try:
        judge = Judge(config, url=server.url if server else config.url, server=server)
        judge.check()
    except BaseException:
        if server is not None:
            server.close()
        raise
    return judge
