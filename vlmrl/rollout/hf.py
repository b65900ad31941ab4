"""The transformers reference backend: one `generate` per request, exactly as the model's own code runs it.

It is the yardstick the engines are compared against (greedy outputs, logprobs) and the fallback where no engine
is installed; it is not fast. Images are the request's already-resized images, turned into pixel values by the
model's own image processor (through `vlmrl.processors`); the prompt is expanded to one `<|image_pad|>` per merged
patch, and transformers computes its own mrope positions from `mm_token_type_ids` (independent of vlmrl's rope code),
except with a video on Qwen2.5-VL: there transformers 5.19 places the text after a long video elsewhere than the model
was trained with and than both engines do, so this model instance computes vlmrl's (`_engine_rule_rope_index`).

Logprobs: log_softmax of the raw logits (`output_logits`, before temperature, top-p/top-k and the pad-token ban).
Banned tokens: `suppress_tokens` (-inf before sampling). Seeds: a request's samples come from torch's generator
seeded with `seed + position * n` inside `fork_rng`, so the caller's global RNG is untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from vlmrl.rollout.base import BackendOptions, DeadlineRunner, RolloutBackend
from vlmrl.rollout.requests import finish_at_stop, sample_seed, top_allowed
from vlmrl.rollout.scoring import ScoredResponse
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams


class HFBackend(RolloutBackend):
    """transformers `generate`, one request at a time; weights updated in place."""

    name = "hf"
    accepts_partial_weights = True  # parameters are copied in place, by name

    def __init__(self, model_path: str, options: BackendOptions):
        super().__init__(model_path, options)
        device = self.rollout.hf.device
        self.device = torch.device(device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
        self._runner = DeadlineRunner(self.name)
        self.model = self._runner.call("load the model", self._load, self.rollout.start_timeout_s)
        self._params = {self.processor.family.weights.checkpoint_name(n): p for n, p in self.model.named_parameters()}

    def _load(self):
        from transformers import AutoModelForImageTextToText, GenerationConfig

        dtype = getattr(torch, self.options.resolved_dtype(self.processor.family))
        model = AutoModelForImageTextToText.from_pretrained(self.model_path, dtype=dtype,
                                                            **self.rollout.hf.engine_kwargs)
        # generate() fills every field a GenerationConfig leaves at its default from the model's
        # generation_config.json (Qwen2.5-Instruct ships repetition_penalty 1.05, top_k, top_p...). The engines take
        # the sampling settings vlmrl passes and nothing else, so the reference must not inherit those either.
        model.generation_config = GenerationConfig()
        # one grid per video: t can pass max(h, w)
        if self.processor.family.inputs.video_timing == "second_per_grid_ts":
            _engine_rule_rope_index(model.model, self.processor)
        return model.to(self.device).eval()

    # ------------------------------------------------------------------------------------------------ generate

    def _generate(self, requests: Sequence[RolloutRequest], sampling: SamplingParams) -> list[RolloutResult]:
        def run() -> list[RolloutResult]:
            results: list[RolloutResult] = []
            for position, request in enumerate(requests):
                results.extend(self._generate_one(request, position, sampling))
            return results

        return self._runner.call(f"generate {len(requests)} requests", run, self.rollout.timeout_s)

    def model_inputs(self, request: RolloutRequest, response_ids: Sequence[int] = ()) -> dict[str, torch.Tensor]:
        """input_ids (1, L) expanded prompt (+ response), attention_mask, mm_token_type_ids (1 on image tokens, 2 on
        video tokens, as transformers' processor gives them; 0 over the response) and the image and video inputs
        (the request's frames through the model's video processor, with their timing: second_per_grid_ts)."""
        mm = self.processor.multi_modal_inputs(request)
        ids = self.processor.expand_prompt_ids(request.prompt_ids, mm.get("image_grid_thw"),
                                               mm.get("video_grid_thw"), request.videos) + list(response_ids)
        input_ids = torch.tensor([ids], dtype=torch.long)
        types = ((input_ids == self.processor.image_token_id).to(torch.int32)
                 + 2 * (input_ids == self.processor.video_token_id).to(torch.int32))
        inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "mm_token_type_ids": types}
        for key, value in mm.items():
            inputs[key] = value.to(self.model.dtype) if key.startswith("pixel_values") else value
        inputs = self.processor.family.inputs.forward_inputs(inputs)  # the keys this family's forward takes
        return {k: v.to(self.device) for k, v in inputs.items()}

    @torch.no_grad()
    def _generate_one(self, request: RolloutRequest, position: int, sampling: SamplingParams) -> list[RolloutResult]:
        from transformers import GenerationConfig

        inputs = self.model_inputs(request)
        stop_ids = set(self.processor.eos_token_ids) | set(sampling.stop_token_ids)
        draws = 1 if sampling.greedy else sampling.n  # greedy samples are identical: compute one, repeat it
        config = GenerationConfig(
            do_sample=not sampling.greedy, max_new_tokens=sampling.max_new_tokens, num_return_sequences=draws,
            eos_token_id=sorted(stop_ids), pad_token_id=self.processor.pad_token_id,
            suppress_tokens=list(request.banned_token_ids) or None, output_logits=True, return_dict_in_generate=True,
            **({} if sampling.greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                           "top_k": max(sampling.top_k, 0)}),  # top_k 0 = off in transformers
        )
        seed = sample_seed(sampling, position)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(**inputs, generation_config=config)
        prompt_len = inputs["input_ids"].shape[1]
        logprobs = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)  # (draws, T, V) raw
        results = []
        for i in range(sampling.n):
            row = i % draws
            ids, reason = finish_at_stop(out.sequences[row, prompt_len:].tolist(), stop_ids)
            steps = torch.arange(len(ids))
            token_lps = logprobs[row, steps, torch.tensor(ids, dtype=torch.long)].tolist()
            tops = None
            if sampling.top_logprobs:
                k = sampling.top_logprobs + len(request.banned_token_ids)
                values, indices = logprobs[row, : len(ids)].topk(k, dim=-1)
                tops = [top_allowed(dict(zip(ix.tolist(), v.tolist())), sampling.top_logprobs,
                                    request.banned_token_ids) for v, ix in zip(values, indices)]
            results.append(RolloutResult(uid=request.uid, sample_index=i, response_ids=ids,
                                         response_logprobs=token_lps, finish_reason=reason, top_logprobs=tops))
        return results

    # ------------------------------------------------------------------------------------------------ scoring

    def _score(self, requests: Sequence[RolloutRequest], responses: list[list[int]], top_k: int
               ) -> list[ScoredResponse]:
        @torch.no_grad()
        def run() -> list[ScoredResponse]:
            scores = []
            for request, response in zip(requests, responses):  # one forward each, as generate runs them
                inputs = self.model_inputs(request, response)
                start = inputs["input_ids"].shape[1] - len(response)
                logits = self.model(**inputs, use_cache=False).logits[0, start - 1:-1].float()  # (R, V)
                targets = torch.tensor(response, dtype=torch.long, device=logits.device)
                logprobs = torch.log_softmax(logits, dim=-1)
                top = []
                if top_k:
                    values, ids = logprobs.topk(top_k, dim=-1)  # (R, k)
                    top = [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
                scores.append(ScoredResponse(logprobs.gather(1, targets[:, None])[:, 0].tolist(), top))
            return scores

        return self._runner.call(f"score {len(requests)} responses", run, self.rollout.timeout_s)

    # ------------------------------------------------------------------------------------------------ weights

    def expert_layout(self):
        return None  # transformers' own model: its fused expert tensors as they are

    def _update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], names: Sequence[str] | None
                        ) -> None:
        sync = self.sync_plan(named_tensors, names)
        unknown = sorted(sync.names - set(self._params))
        if unknown:
            raise ValueError(f"{self.name}: update_weights got {len(unknown)} name(s) the model does not have, "
                             f"e.g. {unknown[:3]}")
        for bucket in sync.buckets:
            self._runner.call(f"load {len(bucket)} tensors", lambda bucket=bucket: self._load_bucket(bucket),
                              self.rollout.timeout_s)
            del bucket  # host memory holds one bucket while the next is read

    @torch.no_grad()
    def _load_bucket(self, bucket: dict[str, torch.Tensor]) -> None:
        for name, tensor in bucket.items():
            param = self._params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != the model's {tuple(param.shape)}")
            param.copy_(tensor.to(dtype=param.dtype))

    def releases_memory(self) -> bool:
        return self.device.type == "cuda"  # the model moves to host memory and back

    def why_no_release(self) -> str:
        return f"the reference model runs on {self.device}"

    def _sleep(self) -> bool:
        self._runner.call("offload to CPU", lambda: self.model.to("cpu"), self.rollout.timeout_s)
        torch.cuda.empty_cache()
        return False  # the weights are kept, in host memory

    def _wake_up(self, tags: list[str]) -> None:
        if "weights" in tags:  # the model has no KV cache between calls
            self._runner.call("reload to the GPU", lambda: self.model.to(self.device), self.rollout.timeout_s)

    def close(self) -> None:
        self._runner.stop()
        self.model = None
        self._params = {}


def _engine_rule_rope_index(base_model: torch.nn.Module, processor) -> None:
    """Make this Qwen2.5-VL instance place video positions by vlmrl's rule (the model's and the engines',
    `vlmrl.processors.rope`), not transformers 5.19's (which continues the text after a long video too early).

    transformers computes mrope positions in `Qwen2_5_VLModel.get_rope_index` only: generate's prefill calls it
    (`_prepare_position_ids_for_generation`) and keeps the rope deltas it returns for the decode steps, and a plain
    forward given `mm_token_type_ids` calls it too (`compute_3d_position_ids`). Replacing it on the instance covers
    both. Inputs without a video go to transformers' own code, where both rules agree.
    """
    original = base_model.get_rope_index

    def get_rope_index(input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor | None = None,
                       image_grid_thw: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                       second_per_grid_ts: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                       **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if video_grid_thw is None:
            return original(input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw,
                            second_per_grid_ts=second_per_grid_ts, attention_mask=attention_mask, **kwargs)
        positions = processor.position_ids(input_ids, attention_mask, image_grid_thw, video_grid_thw,
                                           second_per_grid_ts)  # (3, B, L)
        attended = input_ids.shape[1] if attention_mask is None else attention_mask.sum(dim=1)
        # transformers' rope deltas: the position after the last one, minus the attended length, per row (B, 1)
        deltas = positions.amax(dim=(0, 2)) + 1 - attended
        return positions, deltas.reshape(-1, 1)

    base_model.get_rope_index = get_rope_index
