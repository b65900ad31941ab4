"""The multi-turn agent rollout: every sample is a conversation, all of a step's samples run concurrently.

    loop = AgentLoop(backend, processor, config.agent, prompt_length=P, response_length=R)
    batch = loop.run(requests, sampling, policy_version=step)         # every group to the end (validation)
    batch = loop.step(requests, sampling, batch_size=B, policy_version=step)   # partial rollout when enabled

One trajectory: the backend generates an assistant turn from the whole conversation so far (unexpanded ids, every
image so far, in order); tool calls in it are parsed and executed; their replies become a tool turn (response_mask 0,
images resized by the processor's rules); repeat until a turn calls no tool or a limit is hit. The trajectory is
padded (`vlmrl.batch.padding.pad_sample`) the moment it ends. Trajectories run as asyncio tasks; their turns are
batched into backend calls by `TurnBatcher`, so this works with every backend unchanged.

Partial rollout (`agent.partial`): `step` starts ceil(B * oversample_factor) groups (carried ones first), returns as
soon as B groups have finished, and carries the rest into the next step (or drops them). A trajectory stops only
between backend calls (between turns, or between `chunk_tokens`-sized pieces of a turn), and every token keeps the
policy version that generated it. `save_carried` / `restore_carried` put the carried groups into a checkpoint and
back (`vlmrl.agent.carry`), so a resumed run continues them exactly where they parked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmrl.agent.batcher import TurnBatcher
from vlmrl.agent.carry import ToolEntries, from_json, read_carried, to_json, write_carried
from vlmrl.agent.config import AgentConfig
from vlmrl.agent.loop_metrics import step_metrics
from vlmrl.agent.parser import ToolCall, ToolCallError, parse_tool_calls
from vlmrl.agent.tools import Tool, ToolContext, ToolRegistry, ToolTimeout, as_output, call_tool_method
from vlmrl.agent.trajectory import AgentSample, Trajectory, to_sample
from vlmrl.agent.turns import ToolReply, TurnRenderer
from vlmrl.processors.images import ImageInputError, image_hash, load_image
from vlmrl.types import PromptInputs, RolloutRequest, RolloutResult, Sample, SamplingParams
from vlmrl.utils.executor import DaemonExecutor

if TYPE_CHECKING:
    from vlmrl.processors.base import Processor
    from vlmrl.rollout.base import RolloutBackend

logger = logging.getLogger(__name__)


@dataclass
class CreateFailed:
    """Stands in for the state of a tool whose `create` failed: calls to it get this message."""

    message: str


@dataclass
class Group:
    """One prompt and its n trajectories (a GRPO group). Unstarted until its first backend call returns."""

    request: RolloutRequest
    trajectories: list[Trajectory] = field(default_factory=list)
    samples: dict[int, AgentSample] = field(default_factory=dict)
    """Finished trajectories, padded, by sample index."""
    prompt: PromptInputs | None = None
    resumed: bool = False
    """Carried in from an earlier step."""

    @property
    def started(self) -> bool:
        return bool(self.trajectories)

    @property
    def done(self) -> bool:
        return self.started and len(self.samples) == len(self.trajectories)


@dataclass
class AgentBatch:
    """What a step returns: finished groups only, request-major like `RolloutBackend.generate`."""

    requests: list[RolloutRequest]
    """One per group: in request order from `run`, in the order the groups finished from a partial `step`."""
    samples: list[AgentSample]
    """n per request, sample index order within each group."""
    metrics: dict[str, float]

    @property
    def train_samples(self) -> list[Sample]:
        """The padded samples the trainer stacks (`vlmrl.batch.padding.scored_batch`), in `samples` order."""
        return [s.sample for s in self.samples]

    @property
    def final_answers(self) -> list[str]:
        """What the reward reads: each trajectory's last assistant turn (tool replies are not the model's answer)."""
        return [s.assistant_texts[-1] if s.assistant_texts else "" for s in self.samples]

    @property
    def results(self) -> list[RolloutResult]:
        """The samples as RolloutResults (the whole real response, tool turns included) for validation's metrics
        and artifact; logprobs are 0 on tool tokens."""
        results = []
        for agent_sample in self.samples:
            s = agent_sample.sample
            real = s.attention_mask[s.prompt_ids.shape[0]:].bool()
            ids = s.response_ids[real].tolist()
            logprobs = s.rollout_logprobs[real].tolist() if s.rollout_logprobs is not None else [0.0] * len(ids)
            results.append(RolloutResult(s.uid, agent_sample.sample_index, ids, logprobs, s.finish_reason))
        return results


class AgentLoop:
    """Multi-turn rollout with tools over any `RolloutBackend` (see the module docstring)."""

    def __init__(self, backend: RolloutBackend, processor: Processor, config: AgentConfig, *, prompt_length: int,
                 response_length: int, tools: ToolRegistry | None = None):
        config.validate()
        self.backend, self.processor, self.config = backend, processor, config
        self.prompt_length, self.response_length = prompt_length, response_length
        self.budget = min(config.max_response_tokens, response_length)
        self.tools = tools if tools is not None else ToolRegistry.from_specs(config.tools)
        self.renderer = TurnRenderer(processor.hf_processor, processor.tokenizer, processor.image_token_id,
                                     config.tool_turn_format)
        self._tool_pool = DaemonExecutor(config.tool_workers, "vlmrl-tool")  # an overrun call cannot block exit
        self._backend_pool = ThreadPoolExecutor(config.max_concurrent_generate, thread_name_prefix="vlmrl-agent")
        self._carried: list[Group] = []
        logger.info("agent loop: tools %s, max_turns %d, response budget %d tokens, partial rollout %s",
                    self.tools.names, config.max_turns, self.budget,
                    dataclasses.asdict(config.partial) if config.partial.enable else "off")

    # ------------------------------------------------------------------------------------------------ public

    @property
    def carried(self) -> list[Group]:
        """Groups parked for the next step (partial rollout, unfinished="carry")."""
        return list(self._carried)

    def prompts_needed(self, batch_size: int) -> int:
        """New prompts the next `step` should get: batch_size, or with partial rollout the over-sampled count
        minus the groups carried in."""
        if not self.config.partial.enable:
            return batch_size
        return max(0, math.ceil(batch_size * self.config.partial.oversample_factor) - len(self._carried))

    def run(self, requests: list[RolloutRequest], sampling: SamplingParams, *, policy_version: int = 0) -> AgentBatch:
        """Roll out every request's group to the end (validation; training without partial rollout)."""
        groups = [Group(r) for r in requests]
        try:
            finished, unfinished, stats = _run_sync(self._collect(groups, sampling, policy_version, need=None))
        except BaseException:
            _run_sync(self._drop(groups))  # release every started trajectory's tool state (sandboxes, connections)
            raise
        assert not unfinished, "without a batch size every group runs to the end"
        return self._batch(groups, stats, policy_version, {})  # in request order, not finishing order

    def step(self, requests: list[RolloutRequest], sampling: SamplingParams, *, batch_size: int,
             policy_version: int) -> AgentBatch:
        """One training step's rollout. Without partial rollout: `run(requests)`. With it: carried groups plus
        `requests` run until `batch_size` groups have finished; the rest are carried or dropped."""
        if not self.config.partial.enable:
            return self.run(requests, sampling, policy_version=policy_version)
        part = self.config.partial
        resumed, stale = [], []
        for group in self._carried:
            oldest = min((v for t in group.trajectories for v in [t.oldest_version] if v is not None),
                         default=policy_version)
            (stale if policy_version - oldest > part.max_staleness else resumed).append(group)
        self._carried = []
        _run_sync(self._drop(stale))
        groups = resumed + [Group(r) for r in requests]
        try:
            finished, unfinished, stats = _run_sync(self._collect(groups, sampling, policy_version, need=batch_size))
        except BaseException:
            _run_sync(self._drop(groups))
            raise
        batch, extra = finished[:batch_size], finished[batch_size:]
        leftover = extra + unfinished  # finished extras first: they complete at once next step
        if part.unfinished == "carry":
            for group in leftover:
                group.resumed = True
            self._carried = leftover
        else:
            _run_sync(self._drop(leftover))
        counts = {"partial/new_groups": len(requests), "partial/resumed_groups": len(resumed),
                  "partial/dropped_stale_groups": len(stale), "partial/finished_groups": len(finished),
                  "partial/carried_groups": len(leftover) if part.unfinished == "carry" else 0,
                  "partial/dropped_groups": 0 if part.unfinished == "carry" else len(leftover),
                  "partial/unstarted_leftover_groups": sum(not g.started for g in leftover)}
        if len(batch) < batch_size:
            logger.warning("partial rollout: only %d of %d groups finished (too few prompts in flight)",
                           len(batch), batch_size)
        return self._batch(batch, stats, policy_version, counts)

    def save_carried(self, directory: str | os.PathLike) -> int:
        """Write the carried groups into `directory` (`vlmrl.agent.carry`: JSON + safetensors, no pickle); tool states
        go through `Tool.save_state`. The groups stay carried here. Returns how many were written."""
        entries = _run_sync(self._saved_tool_states(self._carried))
        write_carried(Path(directory), [(g.request, g.trajectories) for g in self._carried], entries)
        return len(self._carried)

    def restore_carried(self, directory: str | os.PathLike) -> int | None:
        """Carry the groups `save_carried` wrote into the next `step` of this fresh loop, exactly where they parked:
        the same tokens, logprobs, version tags, images and turn state; finished trajectories padded again; tool
        states rebuilt (`Tool.load_state`, or `create` for tools that save none). Returns how many groups, or None
        when `directory` holds none (a checkpoint written before vlmrl saved them): then nothing is carried."""
        if self._carried:
            raise RuntimeError(f"restore_carried: this loop already carries {len(self._carried)} groups")
        loaded = read_carried(Path(directory))
        part = self.config.partial
        if loaded is None:
            if part.enable and part.unfinished == "carry":
                logger.warning("%s holds no carried partial-rollout groups (an older checkpoint, or a run without "
                               "the agent loop): the next step starts with none", directory)
            return None
        saved, entries = loaded
        if not (part.enable and part.unfinished == "carry"):
            if saved:
                logger.warning("%s: %d carried groups are dropped: this run's partial rollout does not carry "
                               "(agent.partial.enable / unfinished)", directory, len(saved))
            return 0
        groups = [Group(request, trajectories, resumed=True) for request, trajectories in saved]
        for group in groups:
            for traj in group.trajectories:
                if traj.done:
                    self._pad(group, traj)
        recreated = _run_sync(self._restore_tool_states(groups, entries))
        self._carried = groups
        running = [t for g in groups for t in g.trajectories if not t.done]
        logger.info("restored %d carried groups from %s (%d trajectories in flight, %d finished, %d unstarted "
                    "groups)%s", len(groups), directory, len(running), sum(len(g.samples) for g in groups),
                    sum(not g.started for g in groups),
                    f"; tool states created again (the tools save none): {sorted(recreated)}" if recreated else "")
        return len(groups)

    def close(self) -> None:
        """Release the tools of every carried trajectory and stop the thread pools."""
        carried, self._carried = self._carried, []
        if carried:
            _run_sync(self._drop(carried))
        self._tool_pool.shutdown(wait=False, cancel_futures=True)
        self._backend_pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> AgentLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ a step

    async def _collect(self, groups: list[Group], sampling: SamplingParams, version: int,
                       need: int | None) -> tuple[list[Group], list[Group], Any]:
        """Advance every group until all are done, or (need given) until `need` have finished and the others
        have parked. Returns (finished in finishing order, unfinished, batcher stats)."""
        batcher = TurnBatcher(self.backend, self._backend_pool, max_in_flight=self.config.max_concurrent_generate,
                              max_requests=self.config.max_requests_per_call)
        stop = asyncio.Event()
        finished: list[Group] = []

        async def run_group(group: Group) -> None:
            if group.done:  # finished before the last step ended, carried as it was
                pass
            else:
                await self._advance_group(group, sampling, version, batcher, stop)
            if group.done:
                finished.append(group)
                if need is not None and len(finished) >= need and not stop.is_set():
                    stop.set()
                    batcher.withdraw_pending()

        tasks = [asyncio.ensure_future(run_group(g)) for g in groups]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            await batcher.close()
        return finished, [g for g in groups if not g.done], batcher.stats

    async def _advance_group(self, group: Group, sampling: SamplingParams, version: int, batcher: TurnBatcher,
                             stop: asyncio.Event) -> None:
        if not group.started:
            # First turn of every sample in one request with n: the engine shares the prompt's prefill.
            if stop.is_set():
                return
            limit = self._turn_limit(0, 0, sampling)
            results = await batcher.generate(group.request, dataclasses.replace(sampling, max_new_tokens=limit))
            if results is None:  # withdrawn: the batch filled before this group began
                return
            group.trajectories = [Trajectory(group.request, i) for i in range(sampling.n)]
            await asyncio.gather(*(self._first_turn(group, t, r, sampling, version, batcher, stop)
                                   for t, r in zip(group.trajectories, results)))
            return
        await asyncio.gather(*(self._advance(group, t, sampling, version, batcher, stop)
                               for t in group.trajectories if not t.done))

    async def _first_turn(self, group: Group, traj: Trajectory, result: RolloutResult, sampling: SamplingParams,
                          version: int, batcher: TurnBatcher, stop: asyncio.Event) -> None:
        traj.turns, traj.turn_start = 1, 0
        await self._create_tools(traj)
        await self._after_generation(traj, result, version, sampling)
        await self._advance(group, traj, sampling, version, batcher, stop)

    async def _advance(self, group: Group, traj: Trajectory, sampling: SamplingParams, version: int,
                       batcher: TurnBatcher, stop: asyncio.Event) -> None:
        """Generate and act until the trajectory ends or the step asks it to park."""
        while not traj.done:
            if stop.is_set():
                return  # park between backend calls; resumed next step
            new_turn = not traj.open_turn
            so_far = 0 if new_turn else len(traj.response_ids) - traj.turn_start
            limit = self._turn_limit(traj.expanded_length, so_far, sampling)
            if limit <= 0:
                traj.finish("length", "max_response_tokens")
                break
            request = traj.next_request()
            # the context the engine must hold is at most prompt_length + the response budget
            room = self.prompt_length + self.budget - (traj.expanded_length + self._prompt_tokens(group.request))
            results = await batcher.generate(request, dataclasses.replace(sampling, n=1, max_new_tokens=limit),
                                             room=max(room, limit))
            if results is None:
                return  # withdrawn before generating: park
            if new_turn:
                traj.turns += 1
                traj.turn_start = len(traj.response_ids)
            await self._after_generation(traj, results[0], version, sampling)
        await self._finalize(group, traj)

    def _prompt_tokens(self, request: RolloutRequest) -> int:
        """Expanded length of a request's prompt (as the engine counts it)."""
        return (len(request.prompt_ids) + sum(self.processor.image_token_count(im) - 1 for im in request.images)
                + sum(self.processor.video.token_count(v) - 1 for v in request.videos))

    def _turn_limit(self, expanded_length: int, turn_so_far: int, sampling: SamplingParams) -> int:
        """New tokens the next call may generate: the response budget left, the turn's limit left, one chunk."""
        turn_cap = min(sampling.max_new_tokens, self.config.max_turn_tokens or sampling.max_new_tokens)
        limit = min(self.budget - expanded_length, turn_cap - turn_so_far)
        if self.config.partial.enable and self.config.partial.chunk_tokens:
            limit = min(limit, self.config.partial.chunk_tokens)
        return limit

    # ------------------------------------------------------------------------------------------------ one turn

    async def _after_generation(self, traj: Trajectory, result: RolloutResult, version: int,
                                sampling: SamplingParams) -> None:
        """Record a backend result; when it closes the turn, run its tool calls and append the tool turn."""
        traj.add_generated(result, version)
        if result.finish_reason == "abort":
            traj.finish("abort", "abort")
            return
        if result.finish_reason == "length":
            turn_cap = min(sampling.max_new_tokens, self.config.max_turn_tokens or sampling.max_new_tokens)
            if traj.expanded_length >= self.budget:
                traj.finish("length", "max_response_tokens")
            elif len(traj.response_ids) - traj.turn_start >= turn_cap:
                traj.finish("length", "max_turn_tokens")
            else:
                traj.open_turn = True  # a chunk boundary: the same turn goes on with the next call
            return
        traj.open_turn = False
        turn_ids = traj.response_ids[traj.turn_start:]
        tokenizer = self.processor.tokenizer
        traj.assistant_texts.append(tokenizer.decode(turn_ids, skip_special_tokens=True))
        calls = parse_tool_calls(tokenizer.decode(turn_ids, skip_special_tokens=False))
        if not calls:
            traj.finish("stop", "no_tool_call")
            return
        traj.count("tool/calls", len(calls))
        if traj.turns >= self.config.max_turns:
            traj.finish("stop", "max_turns")
            return
        allowed = self.config.max_tool_calls_per_turn
        replies = list(await asyncio.gather(*(self._execute(traj, call) for call in calls[:allowed])))
        for _ in calls[allowed:]:
            traj.count("tool/over_limit_calls")
            replies.append(ToolReply(f"Error: only {allowed} tool call(s) per turn are executed; this one was not."))
        images = [im for reply in replies for im in reply.images]
        ids = self.renderer.tool_turn_ids(replies, traj.response_ids[-1])
        expanded = len(ids) + sum(self.processor.image_token_count(im) - 1 for im in images)
        if traj.expanded_length + expanded >= self.budget:  # no room for the reply and one more token
            traj.count("tool/replies_over_budget")
            traj.finish("length", "max_response_tokens")
            return
        traj.tool_turns.append([[self.renderer.neutralise(reply.text), len(reply.images)] for reply in replies])
        traj.add_tool_turn(ids, images, [image_hash(im) for im in images], expanded)

    async def _execute(self, traj: Trajectory, call: ToolCall | ToolCallError) -> ToolReply:
        """One call -> the reply the model sees. Every failure becomes an error message, never an exception."""
        if isinstance(call, ToolCallError):
            traj.count("tool/format_errors")
            return ToolReply(f"Error: {call.message}.")
        tool = self.tools.get(call.name)
        if tool is None:
            traj.count("tool/unknown_tool")
            return ToolReply(f"Error: there is no tool named {call.name!r}; available: {', '.join(self.tools.names)}.")
        state = traj.tool_states.get(call.name)
        if isinstance(state, CreateFailed):
            traj.count("tool/errors")
            return ToolReply(f"Error: tool {call.name!r} is unavailable: {state.message}")
        try:
            output = as_output(await call_tool_method(tool.execute, state, call.arguments,
                                                      timeout_s=self.config.tool_timeout_s, executor=self._tool_pool))
        except ToolTimeout as err:
            traj.count("tool/timeouts")
            return ToolReply(f"Error: tool {call.name!r} {err}.")
        except Exception as err:  # a broken tool is the model's observation, not a crashed step
            traj.count("tool/errors")
            logger.debug("tool %r raised on trajectory %s", call.name, traj.key, exc_info=err)
            return ToolReply(f"Error: tool {call.name!r} failed: {type(err).__name__}: {err}")
        traj.count(f"tool/{call.name}/calls")
        for name, value in output.metrics.items():
            traj.count(f"tool/{call.name}/{name}", float(value))
        return self._reply(traj, call.name, output.text, output.images)

    def _reply(self, traj: Trajectory, tool_name: str, text: str, images: list) -> ToolReply:
        """Cut long text; resize images by the processor's rules; keep within the per-trajectory image limit."""
        limit = self.config.max_tool_response_chars
        if len(text) > limit:
            text = text[:limit] + "...(truncated)"
        shown, notes = [], []
        for i, image in enumerate(images):
            if len(traj.tool_images) + len(shown) >= self.config.max_tool_images:
                notes.append(f"(image {i} not shown: at most {self.config.max_tool_images} tool images per "
                             "conversation)")
                traj.count("tool/images_over_limit")
                continue
            try:
                rgb = load_image(image, self.processor.config)  # the data.* image-safety settings
                shown.append(self.processor.prepare_image(rgb, "an image"))  # as a row's images are
            except ImageInputError as err:
                traj.count("tool/bad_images")
                notes.append(f"(image {i} from {tool_name!r} is unusable: {err})")
        traj.count("tool/images", len(shown))
        return ToolReply("\n".join([text] + notes) if notes else text, shown)

    # ------------------------------------------------------------------------------------------------ lifecycle

    async def _method(self, method, *args):
        return await call_tool_method(method, *args, timeout_s=self.config.tool_timeout_s, executor=self._tool_pool)

    async def _create_tools(self, traj: Trajectory) -> None:
        context = ToolContext(traj.request, traj.sample_index)
        for tool in self.tools:
            traj.tool_states[tool.name] = await self._start_tool(traj, tool, tool.create, context)

    async def _start_tool(self, traj: Trajectory, tool: Tool, start, *args) -> Any:
        """`start(*args)` (the tool's create, or load_state on resume) -> its state for `traj`. A failure is counted
        and becomes CreateFailed: the model is told the tool is unavailable."""
        try:
            return await self._method(start, *args)
        except Exception as err:
            traj.count("tool/create_errors")
            logger.warning("tool %r: %s failed for trajectory %s: %s", tool.name, getattr(start, "__name__", start),
                           traj.key, err)
            return CreateFailed(f"it failed to start ({type(err).__name__}: {err})")

    async def _release(self, traj: Trajectory, with_reward: bool) -> None:
        """reward (when the trajectory finished) then release, for every tool; failures are counted, not raised."""
        states, traj.tool_states = traj.tool_states, {}
        for name, state in states.items():
            tool = self.tools.get(name)
            if isinstance(state, CreateFailed) or tool is None:
                continue
            if with_reward:
                try:
                    value = await self._method(tool.reward, state)
                    if value is not None:
                        traj.tool_rewards[name] = float(value)
                except Exception as err:
                    traj.count("tool/reward_errors")
                    logger.warning("tool %r: reward failed for trajectory %s: %s", name, traj.key, err)
            try:
                await self._method(tool.release, state)
            except Exception as err:
                traj.count("tool/release_errors")
                logger.warning("tool %r: release failed for trajectory %s: %s", name, traj.key, err)

    async def _finalize(self, group: Group, traj: Trajectory) -> None:
        """Reward and release the tools, then pad the sample right here, as it finishes."""
        await self._release(traj, with_reward=True)
        self._pad(group, traj)

    def _pad(self, group: Group, traj: Trajectory) -> None:
        """A finished trajectory -> its group's padded sample (also when a checkpoint brings it back)."""
        if group.prompt is None:
            group.prompt = self.processor.prompt_inputs(group.request)
        agent_sample = to_sample(traj, self.processor, group.prompt, prompt_length=self.prompt_length,
                                 response_length=self.response_length)
        agent_sample.sample.reward_extra.update({f"tool/{k}": v for k, v in traj.tool_rewards.items()})
        group.samples[traj.sample_index] = agent_sample

    # ------------------------------------------------------------------------------------------------ checkpoints

    async def _saved_tool_states(self, groups: list[Group]) -> dict[str, ToolEntries]:
        """Each unfinished trajectory's tool states as checkpoint entries, by trajectory key."""
        entries: dict[str, ToolEntries] = {}
        for group in groups:
            for traj in group.trajectories:
                if not traj.done:
                    entries[traj.key] = {name: await self._saved_tool_state(traj, name, state)
                                         for name, state in traj.tool_states.items()}
        return entries

    async def _saved_tool_state(self, traj: Trajectory, name: str, state: Any) -> dict[str, Any]:
        if isinstance(state, CreateFailed):
            return {"create_failed": state.message}
        try:
            saved = await self._method(self.tools.get(name).save_state, state)
            return {"recreate": True} if saved is None else {"state": to_json(saved, f"tool {name!r} state")}
        except Exception as err:  # the checkpoint still gets written; the resumed run creates this state again
            logger.warning("tool %r: cannot save the state of trajectory %s (%s: %s); a resumed run creates it again",
                           name, traj.key, type(err).__name__, err)
            return {"recreate": True}

    async def _restore_tool_states(self, groups: list[Group], entries: dict[str, ToolEntries]) -> set[str]:
        """Rebuild the tool states of every unfinished trajectory; returns the tools whose state was created again."""
        recreated: set[str] = set()

        async def restore(traj: Trajectory) -> None:
            saved = entries.get(traj.key, {})
            for name in sorted(set(saved) - set(self.tools.names)):
                logger.warning("trajectory %s: tool %r of the checkpoint is not configured; its state is dropped",
                               traj.key, name)
            context = ToolContext(traj.request, traj.sample_index)
            for tool in self.tools:
                entry = saved.get(tool.name, {"recreate": True})  # a tool configured since: created like a new one
                if "state" not in entry and "create_failed" not in entry:
                    recreated.add(tool.name)
                traj.tool_states[tool.name] = await self._restored_tool_state(tool, context, entry, traj)

        await asyncio.gather(*(restore(t) for g in groups for t in g.trajectories if not t.done))
        return recreated

    async def _restored_tool_state(self, tool: Tool, context: ToolContext, entry: dict[str, Any],
                                   traj: Trajectory) -> Any:
        if "create_failed" in entry:
            return CreateFailed(entry["create_failed"])
        if "state" in entry:
            return await self._start_tool(traj, tool, tool.load_state, context, from_json(entry["state"]))
        return await self._start_tool(traj, tool, tool.create, context)

    async def _drop(self, groups: list[Group]) -> None:
        for group in groups:
            for traj in group.trajectories:
                if not traj.done:
                    traj.finish("abort", "dropped")
                    await self._release(traj, with_reward=False)

    def _batch(self, groups: list[Group], stats: Any, version: int, counts: dict[str, float]) -> AgentBatch:
        samples = [g.samples[i] for g in groups for i in sorted(g.samples)]
        metrics = step_metrics(samples, stats, version, self.tools.names)
        metrics.update({k: float(v) for k, v in counts.items()})
        return AgentBatch([g.request for g in groups], samples, metrics)


def _run_sync(coro):
    """asyncio.run, also from a thread that already runs an event loop (a notebook): then in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as err:  # handed back to the caller's thread
            box["error"] = err

    thread = threading.Thread(target=target, name="vlmrl-agent-loop")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
