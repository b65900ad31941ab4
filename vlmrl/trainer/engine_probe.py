"""Probing the engine: the fit loop's share of the weights probe (its judgement and records are
`vlmrl.alignment.weight_probe`). After every weight sync, and once before the first step (the start-up check; a
resumed run checks its restarted engine the same way, recording nothing), the engine answers one fixed request
greedily and the trainer scores its tokens.

The request is the first training row that builds (with its image or video when the data has them, so the vision
tower's weights are probed too), the same for the whole run. At trainer.n_gpus_per_node x trainer.nnodes > 1 it goes
to the engine the colocated group sends a one-request call to, and the sharded actor scores it (padding rows up to a
multiple of the ranks). The record goes to OUTPUT_DIR/drift/probe_<step>.json, its numbers into the step's metrics
(weight_probe/*). A failed probe is logged as a warning, or (trainer.weight_probe_action=error) stops the run.
"""

from __future__ import annotations

import logging

import torch

from vlmrl.alignment.weight_probe import IN_SYNC, ProbeRecord, ProbeState, judge, tolerance_for, write_probe
from vlmrl.batch.padding import pad_results, scored_batch
from vlmrl.data.dataset import build_requests
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams

logger = logging.getLogger(__name__)

ROWS_TRIED = 16
"""The probe takes the first of this many training rows that builds (the others are filtered)."""


class WeightProbeError(RuntimeError):
    """trainer.weight_probe_action=error and a probe found the engine off the trainer's weights."""


class EngineModelError(WeightProbeError):
    """The start-up probe (before step 1) found the engine computing another model than the trainer: whatever
    trainer.weight_probe_action says, the run stops there (`python -m vlmrl.train` prints it as one error line)."""


def probe_request(processor, train_data) -> RolloutRequest | None:
    """The run's probe request: the first training row (of the first ROWS_TRIED) that the processor does not filter
    and that holds an image or a video, so that the vision side is probed too; else the first that builds."""
    first = None
    for index in range(min(len(train_data), ROWS_TRIED)):
        built = build_requests(processor, train_data, [index])
        if built.requests:
            request = built.requests[0]
            request.uid = f"weight-probe-{index}"
            if request.images or request.videos:
                return request
            first = first or request
    return first


class WeightProbe:
    """A run's probe: its request, what the next probe is judged against (`ProbeState`: a checkpoint keeps it,
    `state_dict`) and the last record. `output_dir`: where each record is written (None: not written)."""

    def __init__(self, request: RolloutRequest | None, processor, *, tokens: int, prompt_length: int,
                 temperature: float, action: str = "warn", output_dir=None):
        self.request, self.processor, self.tokens, self.prompt_length = request, processor, tokens, prompt_length
        self.temperature, self.action, self.output_dir = temperature, action, output_dir
        self.state = ProbeState()
        self.last: ProbeRecord | None = None
        self._prompt = None  # the request's prompt inputs, built once
        self._dtypes: tuple[str, str, float] | None = None  # (engine, trainer, tolerance): fixed for the run

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)

    @classmethod
    def for_run(cls, config, processor, train_data, output_dir) -> WeightProbe:
        """The probe of a run of `config`."""
        request = probe_request(processor, train_data)
        if request is None:
            logger.warning("weight probe off: none of the first %d training rows builds a request", ROWS_TRIED)
        # never longer than a response: the engine holds prompt + data.max_response_length tokens
        return cls(request, processor, tokens=min(config.trainer.weight_probe_tokens, config.data.max_response_length),
                   prompt_length=config.data.max_prompt_length, temperature=config.rollout.temperature,
                   action=config.trainer.weight_probe_action, output_dir=output_dir)

    def __call__(self, actor, backend, step: int, engine_version: int, at_start: bool = False) -> dict[str, float]:
        """Probe the engine after step `step`'s sync (its record is `last`); returns the weight_probe/* metrics ({}
        when the probe is off or the engine returned no logprobs). `at_start`: the start-up check before step 1,
        where a failed probe means the engine computes another model than the trainer from the start (an engine
        that reads the config otherwise, skips weights it does not expect, or loaded other weights): it raises
        EngineModelError whatever `action` says."""
        measured = self._measure(actor, backend, step)
        if measured is None:
            return {}
        each, result, trainer = measured
        engine_dtype, trainer_dtype, tolerance = self._resolve_dtypes(actor, backend)
        record = self.last = self.state.judge(step, engine_version, list(result.response_ids),
                                              list(result.response_logprobs), trainer, tolerance)
        if self.output_dir is not None:
            write_probe(self.output_dir, record)
        apart = engines_apart(each, self.state.noise_floor)
        if apart:  # another engine holds other weights than engine 0: its sync did not land (or landed otherwise)
            message = f"step {step}: weight probe: {apart} ({backend.name}, {engine_dtype})"
            if at_start:
                raise EngineModelError(message)
            if self.action == "error":
                raise WeightProbeError(message + "; trainer.weight_probe_action=warn keeps training")
            logger.warning(message)
        if record.failed and at_start:
            raise self._model_error(backend, record)
        if record.failed:
            message = (f"step {step}: weight probe {record.verdict}: {record.explanation} ({backend.name} engine, "
                       f"{engine_dtype}; trainer {trainer_dtype})")
            if self.action == "error":
                raise WeightProbeError(message + "; trainer.weight_probe_action=warn keeps training")
            logger.warning(message)
        metrics = {"weight_probe/max_abs_dlogp": record.max_abs_dlogp,
                   "weight_probe/in_sync": float(record.verdict == IN_SYNC and not apart)}
        if len(each) > 1:
            metrics["weight_probe/engines_agree"] = float(not apart)
        if record.trainer_moved is not None:
            metrics["weight_probe/trainer_moved"] = record.trainer_moved
        if record.landed_fraction is not None:
            metrics["weight_probe/landed_fraction"] = record.landed_fraction
        return metrics

    def check_resumed(self, actor, backend, step: int, engine_version: int) -> None:
        """The start-up check of a resumed run, whose engine started again on the checkpoint of step `step`: as the
        check before step 1 (EngineModelError when the engine computes another model than the trainer, or its
        engines answer apart), judged on the gap alone and recorded nowhere, so that the next probe is judged
        against the checkpoint's reference as the uninterrupted run's is."""
        measured = self._measure(actor, backend, step)
        if measured is None:
            return
        each, result, trainer = measured
        engine_dtype, _, tolerance = self._resolve_dtypes(actor, backend)
        record = judge(step, engine_version, list(result.response_ids), list(result.response_logprobs), trainer,
                       tolerance, noise_floor=self.state.noise_floor)
        apart = engines_apart(each, self.state.noise_floor)
        if apart:
            raise EngineModelError(f"resumed at step {step}: weight probe: {apart} ({backend.name}, {engine_dtype})")
        if record.failed:
            raise self._model_error(backend, record)
        logger.info("resumed at step %d: the %s engine computes the trainer's model (%s)", step, backend.name,
                    record.explanation)

    def _measure(self, actor, backend, step: int):
        """((engine index, its answer) for each engine that holds the last sync's weights, the first one's answer,
        the trainer's logprobs of its tokens), or None when the probe is off or the engine returned no logprobs."""
        if self.request is None:
            return None
        sampling = SamplingParams(n=1, temperature=0.0, max_new_tokens=self.tokens, seed=0)
        # an engine restarted between collective syncs answers nothing: it generates nothing until the next sync
        each = [(k, results[0]) for k, results in enumerate(backend.generate_on_each([self.request], sampling))
                if results]
        if not each:
            logger.warning("step %d: the weight probe found no %s engine that holds the last synced weights: not "
                           "judged", step, backend.name)
            return None
        result = each[0][1]  # the first engine is judged against the trainer; the others against it
        if not result.response_ids or len(result.response_logprobs) != len(result.response_ids):
            logger.warning("step %d: the weight probe got %d tokens and %d logprobs from %s: not judged", step,
                           len(result.response_ids), len(result.response_logprobs), backend.name)
            return None
        return each, result, self._trainer_logprobs(actor, result)

    def _resolve_dtypes(self, actor, backend) -> tuple[str, str, float]:
        """(engine dtype, trainer dtype, tolerance), read once: at dp > 1 the actor's dtype is a call to a worker."""
        if self._dtypes is None:
            engine_dtype = backend.dtype
            trainer_dtype = str(actor.forward_dtype()).removeprefix("torch.")
            tolerance, self.state.noise_floor = tolerance_for(engine_dtype, trainer_dtype)
            self._dtypes = engine_dtype, trainer_dtype, tolerance
        return self._dtypes

    def _model_error(self, backend, record: ProbeRecord) -> EngineModelError:
        engine_dtype, trainer_dtype, tolerance = self._dtypes
        return EngineModelError(
            f"the {backend.name} engine computes another model than the trainer: on the probe request "
            f"({_inputs(self.request)}) its logprobs of its own {len(record.token_ids)} greedy tokens sit up to "
            f"{record.max_abs_dlogp:.3g} nats from the trainer's, beyond the {tolerance:g} a {engine_dtype} "
            f"engine and a {trainer_dtype} trainer may differ ({record.explanation}); compare the two with "
            "`python -m vlmrl.alignment.compare --backends trainer,<engine> --drill-down`, or run on another "
            "engine (trainer.weight_probe_tokens=0 turns this check off)")

    def _trainer_logprobs(self, actor, result) -> list[float]:
        """The trainer's temperature-1 logprobs of the engine's probe tokens (one row, padding rows up to the dp
        ranks), through the update's logprob pass."""
        processor = self.processor
        if self._prompt is None:
            self._prompt = processor.prompt_inputs(self.request)
        samples = pad_results([self._prompt], [result],
                              prompt_length=self.prompt_length, response_length=self.tokens,
                              pad_token_id=processor.pad_token_id, policy_version=0)
        batch = scored_batch(samples, [0.0], [{}], multiple=actor.dp_size, eos_token_id=processor.eos_token_ids[0],
                             pad_token_id=processor.pad_token_id)
        tempered = self.temperature != 1.0  # the actor scores at rollout.temperature; the probe at 1
        if tempered:
            actor.set_temperature(1.0)
        try:
            with torch.no_grad():
                logprobs = actor.compute_logprobs(batch)[0]
        finally:
            if tempered:
                actor.set_temperature(self.temperature)
        return logprobs[0, :len(result.response_ids)].double().tolist()


def _inputs(request: RolloutRequest) -> str:
    """'1 image, 57 prompt tokens', for messages."""
    parts = [f"{len(items)} {kind}{'s' if len(items) != 1 else ''}"
             for kind, items in (("image", request.images), ("video", request.videos)) if items]
    return ", ".join(parts + [f"{len(request.prompt_ids)} prompt tokens"])


def engines_apart(answers: list[tuple[int, RolloutResult]], noise: float) -> str:
    """Why the engines' answers to the probe request differ ('' when they agree): every engine of a run holds the
    same weights after a sync and gets the same request, so their greedy tokens are equal and their logprobs agree
    within the probe's noise floor (float32 rounding, or bfloat16's); an engine whose sync did not land on it
    answers otherwise. `answers`: (engine index, its result), the first judged against the trainer.

    >>> from vlmrl.types import RolloutResult
    >>> a = RolloutResult("p", 0, response_ids=[5, 6], response_logprobs=[-1.0, -2.0], finish_reason="length")
    >>> b = RolloutResult("p", 0, response_ids=[5, 6], response_logprobs=[-1.0, -2.5], finish_reason="length")
    >>> engines_apart([(0, a), (1, a)], 4e-6), engines_apart([(0, a), (2, b)], 4e-6)[:46]
    ('', 'engine 2 answers the probe otherwise than engi')
    """
    (base, first), others = answers[0], answers[1:]
    for index, other in others:
        if list(other.response_ids) != list(first.response_ids):
            return (f"engine {index} answers the probe otherwise than engine {base} (greedy tokens "
                    f"{other.response_ids[:8]} vs {first.response_ids[:8]}): its weights are not engine {base}'s")
        gap = max((abs(a - b) for a, b in zip(other.response_logprobs, first.response_logprobs)), default=0.0)
        if gap > noise:
            return (f"engine {index} answers the probe otherwise than engine {base} (logprobs up to {gap:.3g} "
                    f"apart, beyond {noise:g}): its weights are not engine {base}'s")
    return ""
