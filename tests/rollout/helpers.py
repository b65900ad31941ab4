"""Shared pieces of the rollout tests: the request batch, weight edits, comparisons, and the contract every engine
backend is tested against (`EngineContract`, subclassed once per engine module with its own started engine)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from PIL import Image

from vlmrl.rollout.base import RolloutBackend
from vlmrl.rollout.errors import InvalidRequestError
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, top_logprobs=5)
LOGPROB_TOL = 1e-4
"""Sampled-token logprobs vs HF teacher-forced, fp32: measured <= 5e-6 on both engines; 20x headroom."""
FAVOURED_LOGPROB_TOL = 2e-3
"""Same, when a banned token holds almost all the mass: SGLang's ban correction reads the banned logprob at a
-1e4 offset, where float32 resolves ~1e-3 (see vlmrl.rollout.sglang)."""
BF16_LOGPROB_TOL = 0.5
"""Sampled-token logprobs vs HF teacher-forced when both run bfloat16 (Qwen3.5 on CPU engines). A bfloat16 model sits
up to 0.24 nats from its own float32 computation (measured: HF bf16 vs HF fp32 on the tiny Qwen3.5, teacher-forced on
424 sampled tokens of the nine requests: max 0.237, p99 0.172, mean 0.044), so two bfloat16 implementations may sit
up to twice that from each other. Measured engines vs HF bf16 (288 sampled tokens each): vLLM max 0.216 (p99
0.154, mean 0.033), SGLang max 0.155 (p99 0.125, mean 0.033)."""
BF16_MEAN_LOGPROB_TOL = 0.1
"""The mean of the same differences: twice HF's own bf16-vs-fp32 mean (0.044); measured 0.033 on both engines."""


def sglang_server(model_path: str, tmp_path_factory, label: str, **options):
    """A module fixture's body: an fp32 `sglang-server` launched on the model, its log in a fresh temporary folder
    named `label` (read by the tests that check what the server said); yields the started backend, stops it after."""
    from vlmrl.rollout.registry import get_backend

    log = tmp_path_factory.mktemp(label) / "server.log"
    with get_backend("sglang-server", model_path, dtype="float32", max_model_len=1024, timeout_s=300,
                     log_file=str(log), **options) as started:
        yield started


def noise_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, mode="RGB")


def build_batch(processor) -> list[RolloutRequest]:
    """Nine requests through the real processor: three text-only, three with one image, three with two, all images
    of different sizes (the processor resizes them to multiples of the model's image factor, 28 or 32, within its pixel
    bounds)."""
    specs = [
        ("What is two plus two?", []),
        ("Name a colour.", []),
        ("Say hello.", []),
        ("<image>What is in the picture?", [(112, 112)]),
        ("Describe <image> briefly.", [(200, 90)]),
        ("<image>Count the shapes.", [(60, 150)]),
        ("<image><image>Which image is brighter?", [(112, 84), (70, 70)]),
        ("Compare <image> with <image>.", [(168, 56), (90, 120)]),
        ("<image>First, then <image> second.", [(56, 56), (150, 100)]),
    ]
    rows = [{"data_source": "rollout-test", "prompt": [{"role": "user", "content": text}],
             "images": [noise_image(w, h, seed=10 * i + k) for k, (w, h) in enumerate(sizes)]}
            for i, (text, sizes) in enumerate(specs)]
    return [processor.build_request(row, index=i) for i, row in enumerate(rows)]


def clone_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def perturbed_vision(state: dict[str, torch.Tensor], scale: float = 0.05) -> dict[str, torch.Tensor]:
    """The full state with only the vision tower's weights shifted (seeded)."""
    gen = torch.Generator().manual_seed(7)
    vision = (".visual.", ".vision_tower.", ".multi_modal_projector.")  # Qwen, GLM; InternVL's tower and projector
    return {name: (t + scale * torch.randn(t.shape, generator=gen) if any(v in f".{name}" for v in vision)
                   else t.clone()) for name, t in state.items()}


@torch.no_grad()
def favouring(hf, requests: list[RolloutRequest], token_id: int, strength: float = 3.0, last_only: bool = False
              ) -> dict[str, torch.Tensor]:
    """The full state with lm_head's row for `token_id` pointed along the mean final hidden state of these
    prompts (`last_only`: of their last positions, the ones that predict the first token): that token then
    out-scores every other one by several nats (checked by the caller)."""
    hidden = torch.cat([hf.model(**hf.model_inputs(r), output_hidden_states=True).hidden_states[-1][0]
                        [-1 if last_only else 0:] for r in requests])
    direction = hidden.mean(0) / hidden.mean(0).norm()
    state = clone_state(hf.model)
    state["lm_head.weight"][token_id] = strength * direction
    return state


@functools.lru_cache(maxsize=2)
def _float32_checkpoint(model_path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def float32_checkpoint(model_path: str) -> dict[str, torch.Tensor]:
    """A model folder's parameters in float32 (a fresh copy each call: tests edit what they get)."""
    return {name: t.clone() for name, t in _float32_checkpoint(str(model_path)).items()}


def without_ban(request: RolloutRequest) -> RolloutRequest:
    return dataclasses.replace(request, banned_token_ids=[])


def greedy_mismatch(ref: RolloutResult, got: RolloutResult, backend: str, tie_tol: float = 1e-3) -> str | None:
    """None when the greedy ids are equal, else where they first differ and whether it is a near-tie (both tokens
    within the other's top-5 and |dlogp| < tie_tol on either side) - the message a failing assertion shows."""
    if ref.response_ids == got.response_ids:
        return None
    pos = next((i for i, (a, b) in enumerate(zip(ref.response_ids, got.response_ids)) if a != b),
               min(len(ref.response_ids), len(got.response_ids)))
    if pos >= min(len(ref.response_ids), len(got.response_ids)):
        return f"{ref.uid}: lengths differ ({len(ref.response_ids)} hf vs {len(got.response_ids)} {backend})"
    a, b = ref.response_ids[pos], got.response_ids[pos]
    top_ref, top_got = ref.top_logprobs[pos], got.top_logprobs[pos]
    tie = (b in top_ref and a in top_got
           and abs(top_ref[a] - top_ref[b]) < tie_tol and abs(top_got[a] - top_got[b]) < tie_tol)
    return (f"{ref.uid}: first divergence at token {pos}: hf {a} vs {backend} {b} "
            f"({'near-tie' if tie else 'NOT a near-tie'}; hf top-5 {top_ref}, {backend} top-5 {top_got})")


def is_near_tie_or_equal(ref: RolloutResult, got: RolloutResult, backend: str, tie_tol: float = 1e-3) -> bool:
    message = greedy_mismatch(ref, got, backend, tie_tol)
    return message is None or "(near-tie" in message


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_problems(refs: Sequence[RolloutResult], gots: Sequence[RolloutResult], backend: str, logprob_tol: float,
                    tie_tol: float = 1e-3, ties_allowed: bool = False) -> list[str]:
    """What is wrong with an engine's greedy results against the reference's (empty: nothing): the ids differ
    (`ties_allowed`: only where the split is not a near-tie within `tie_tol` - vLLM's divergence-aware rule: compare
    up to the first differing token, judge it there, stop), or a logprob over the common prefix differs by more
    than `logprob_tol`."""
    problems = []
    for ref, got in zip(refs, gots, strict=True):
        message = greedy_mismatch(ref, got, backend, tie_tol)
        if message is not None and not (ties_allowed and "(near-tie" in message):
            problems.append(message)
        upto = common_prefix(ref.response_ids, got.response_ids)
        drift = max([abs(x - y) for x, y in zip(ref.response_logprobs[:upto], got.response_logprobs[:upto])],
                    default=0.0)
        if drift > logprob_tol:
            problems.append(f"{ref.uid}: logprobs over the {upto} common tokens differ by {drift:.3g} > "
                            f"{logprob_tol:g}")
    return problems


def assert_logprobs_match_hf(hf, requests, results, n: int, tol: float, backend: str) -> float:
    """Every sample's logprobs equal HF's teacher-forced raw logprobs of the same tokens within tol; the largest
    difference is returned."""
    worst = 0.0
    for j, request in enumerate(requests):
        for result in results[j * n:(j + 1) * n]:
            reference = hf.score([request], [result.response_ids])[0]
            diff = max(abs(a - b) for a, b in zip(reference, result.response_logprobs))
            assert diff <= tol, (f"{backend}: request {j} sample {result.sample_index}: logprobs differ from HF "
                                 f"teacher-forced by {diff:.2e} > {tol:g}\n{backend}: {result.response_logprobs}\n"
                                 f"hf: {reference}")
            worst = max(worst, diff)
    return worst


class EngineContract:
    """The behaviour every engine backend must show (the rollout contract). Subclass in a test module that provides the
    fixtures `backend` (module-scoped, started once) and uses the shared `hf`, `batch` and `hf_greedy`.

    The class attributes say how close to HF the engine must be: in float32 (the default) token for token and to
    float rounding; a bfloat16 family (Qwen3.5 on CPU) within bfloat16's noise (`BF16_LOGPROB_TOL`), with greedy
    splits allowed only at near-ties inside that noise."""

    logprob_tol = LOGPROB_TOL
    """|engine - HF| on a token both computed, in the engine's dtype."""
    favoured_logprob_tol = FAVOURED_LOGPROB_TOL
    """The same when a banned token holds almost all the mass."""
    tie_tol = 1e-3
    """A greedy split where both tokens are each in the other's top-5 and within this of each other on both sides is
    a near-tie."""
    ties_allowed = False
    """False: the greedy ids equal HF's on every request; True: equal up to a first split that is a near-tie."""
    min_buckets = 10
    """Buckets of 0.25 MiB the shifted model must fill (a dozen for a 3.4 MB float32 model)."""
    favour_strength = 3.0
    favour_last_positions = False
    """Point the favoured row along the prompts' last positions only, not all of them (a family whose image tokens
    outnumber the text and pull the mean elsewhere)."""
    """How far lm_head's pad-token row is pushed along the prompts' mean hidden state (`favouring`)."""
    probe_scale = 0.02
    """How far (in each tensor's std) the weight-probe test moves every weight of the trainer."""
    partial_verdicts = ("partial",)
    """What the weight probe may call a sync that held the first decoder layer back."""

    def original_state(self, hf) -> dict[str, torch.Tensor]:
        """The weights the engine loaded, to restore after a test moved them: HF's own (the engine's dtype)."""
        return clone_state(hf.model)

    def assert_like_hf(self, refs, gots, backend_name: str, what: str = "") -> None:
        problems = greedy_problems(refs, gots, backend_name, self.logprob_tol, self.tie_tol, self.ties_allowed)
        assert not problems, (what + ":\n" if what else "") + "\n".join(problems)

    def test_greedy_equals_hf(self, backend: RolloutBackend, batch, hf_greedy):
        """Nine requests with 0, 1 and 2 images of different sizes: the same ids as HF, token for token (float32;
        bfloat16: up to a near-tie), and the same logprobs over them."""
        results = backend.generate(batch, GREEDY)
        assert [r.uid for r in results] == [r.uid for r in batch]
        self.assert_like_hf(hf_greedy, results, backend.name)
        for ref, got in zip(hf_greedy, results):
            if ref.response_ids == got.response_ids:
                assert got.finish_reason == ref.finish_reason
        if not self.ties_allowed:
            assert all(list(got.top_logprobs[0]) == list(ref.top_logprobs[0]) for ref, got in zip(hf_greedy, results)
                       ), "top-5 ranking differs at token 0"

    def test_sampling_n4_logprobs_are_raw_and_match_hf(self, backend, hf, batch):
        """n=4 at temperature 0.7: 4 samples per request, request-major, whose logprobs are those of the RAW
        distribution (HF teacher-forced log_softmax of the logits, no temperature)."""
        sampling = SamplingParams(n=4, temperature=0.7, max_new_tokens=8)
        results = backend.generate(batch, sampling)
        assert len(results) == 4 * len(batch)
        for j, request in enumerate(batch):
            own = results[4 * j:4 * j + 4]
            assert [(r.uid, r.sample_index) for r in own] == [(request.uid, i) for i in range(4)]
            assert all(len(r.response_ids) == len(r.response_logprobs) > 0 for r in own)
        assert len({tuple(r.response_ids) for r in results}) > len(batch), "samples of a request are all identical"
        assert_logprobs_match_hf(hf, batch, results, 4, self.logprob_tol, backend.name)

    def test_stop_token_ends_response(self, backend, batch):
        """An extra stop token ends the response right after it (kept), with finish_reason 'stop'. The stop token is
        the first token at position >= 2 not generated before it, in the first image request whose greedy response
        has one (an untrained model may repeat one token)."""
        for request in [r for r in batch if r.images] + [r for r in batch if not r.images]:
            (own,) = backend.generate([request], GREEDY)
            reference = own.response_ids
            position = next((i for i in range(2, len(reference)) if reference[i] not in reference[:i]), None)
            if position is not None:
                break
        assert position is not None, "every greedy response repeats its first tokens"
        sampling = dataclasses.replace(GREEDY, stop_token_ids=[reference[position]])
        (result,) = backend.generate([request], sampling)
        assert result.response_ids == reference[:position + 1]
        assert result.finish_reason == "stop"

    def test_image_count_mismatch_rejected_before_engine(self, backend, batch):
        """Two placeholders but one image: refused before the engine with an error naming the request; the engine
        is untouched and answers the next call."""
        bad = dataclasses.replace(batch[6], uid="two-placeholders-one-image", images=batch[6].images[:1])
        with pytest.raises(InvalidRequestError, match="two-placeholders-one-image.*2 <\\|image_pad\\|> placeholders"):
            backend.generate([batch[0], bad], GREEDY)
        no_placeholder = dataclasses.replace(batch[0], uid="image-without-placeholder", images=batch[3].images)
        with pytest.raises(InvalidRequestError, match="image-without-placeholder"):
            backend.generate([no_placeholder], GREEDY)
        assert backend.generate([batch[3]], GREEDY)[0].response_ids

    def test_pad_token_never_sampled_even_when_favoured(self, backend, hf, batch):
        """With lm_head pushed (through update_weights) to favour <|image_pad|>, HF without the ban picks it first
        for every prompt; the backend never samples it (T=1), and its logprobs are still the raw ones."""
        pad = hf.processor.image_token_id
        original = self.original_state(hf)
        favoured = favouring(hf, batch, pad, self.favour_strength, self.favour_last_positions)
        hf.update_weights(favoured.items())
        try:
            unbanned = hf.generate([without_ban(r) for r in batch], SamplingParams(temperature=0.0, max_new_tokens=1))
            assert all(r.response_ids == [pad] for r in unbanned), "the setting does not favour the pad token"
            backend.update_weights(favoured.items())
            some = batch[::2]  # 0, 1 and 2 images; unbanned, nearly every one of these draws would be the pad token
            results = backend.generate(some, SamplingParams(n=2, temperature=1.0, max_new_tokens=6))
            assert all(pad not in r.response_ids for r in results)
            assert_logprobs_match_hf(hf, some, results, 2, self.favoured_logprob_tol, backend.name)
        finally:
            hf.update_weights(original.items())
            backend.update_weights(original.items())

    def test_weight_sync_lands_and_restores(self, backend, hf, batch):
        """Perturbed vision-tower weights change the outputs for images the engine has already seen (no stale
        embeddings), exactly as HF with the same weights; the originals bring back the very first outputs."""
        first = backend.generate(batch, GREEDY)
        original = self.original_state(hf)
        perturbed = perturbed_vision(original)
        backend.update_weights(perturbed.items())
        hf.update_weights(perturbed.items())
        try:
            after = backend.generate(batch, GREEDY)
            expected = hf.generate(batch, GREEDY)
        finally:
            hf.update_weights(original.items())
        self.assert_like_hf(expected, after, backend.name, "engine with perturbed weights != HF with them")
        changed = [a.response_ids != b.response_ids for a, b in zip(first, after)]
        assert not any(changed[:3]), "text-only outputs changed although only the vision tower did"
        # the perturbation must show in some image request's output, else the comparison with HF above tests nothing
        assert any(changed[3:]), f"no output for a seen image changed: {changed}"
        backend.update_weights(original.items())
        restored = backend.generate(batch, GREEDY)
        assert [r.response_ids for r in restored] == [r.response_ids for r in first]
        assert all(max(abs(a - b) for a, b in zip(x.response_logprobs, y.response_logprobs)) < 1e-5
                   for x, y in zip(first, restored))

    def test_bucketed_weight_sync_lands_and_restores(self, backend, hf, batch):
        """Every weight shifted and pushed in buckets of 0.25 MiB (the tiny model is 3.4 MB: a dozen buckets, and
        layers whose tensors straddle two of them): the outputs are HF's with the same weights (HF loaded in
        buckets too), and the originals, bucketed, bring back the first outputs."""
        first = backend.generate(batch, GREEDY)
        original = self.original_state(hf)
        gen = torch.Generator().manual_seed(11)
        shifted = {name: t + 0.02 * t.std() * torch.randn(t.shape, generator=gen) for name, t in original.items()}
        sizes = (backend.rollout.sync_bucket_mb, hf.rollout.sync_bucket_mb)
        backend.rollout.sync_bucket_mb = hf.rollout.sync_bucket_mb = 0.25
        try:
            assert len(list(backend.sync_plan(shifted.items()).buckets)) >= self.min_buckets
            backend.update_weights(shifted.items())
            hf.update_weights(shifted.items())
            try:
                after = backend.generate(batch, GREEDY)
                expected = hf.generate(batch, GREEDY)
            finally:
                hf.update_weights(original.items())
            self.assert_like_hf(expected, after, backend.name, "engine with bucketed weights != HF with them")
            assert sum(a.response_ids != b.response_ids for a, b in zip(first, after)) >= len(batch) // 2
            backend.update_weights(original.items())
        finally:
            backend.rollout.sync_bucket_mb, hf.rollout.sync_bucket_mb = sizes
        restored = backend.generate(batch, GREEDY)
        assert [r.response_ids for r in restored] == [r.response_ids for r in first]

    def test_the_weight_probe_tells_a_stale_a_partial_and_a_landed_sync(self, backend, batch):
        """The trainer (an Actor on the engine's model, float32) moves every weight; the probe (an image request,
        greedy, the trainer teacher-forced through its logprob pass) then tells the three syncs apart: none (stale,
        the engine made none of the trainer's movement), one that holds the first decoder layer's tensors back
        (landed partly, though every tensor name arrived), and the whole one (in sync). The engine gets its first
        weights back after."""
        from vlmrl.actor.local import Actor
        from vlmrl.alignment.weight_probe import IN_SYNC, STALE
        from vlmrl.config import load_config
        from vlmrl.trainer.engine_probe import WeightProbe

        config = load_config([f"actor.model_path={backend.model_path}", "data.train_files=synthetic",
                              "data.val_files=synthetic", "actor.dtype=float32"])
        actor = Actor(config.actor, total_steps=1, mini_batch_samples=4)
        original = {name: t.detach().clone() for name, t in actor.named_tensors()}
        gen = torch.Generator().manual_seed(11)
        moved = {name: t + self.probe_scale * t.std() * torch.randn(t.shape, generator=gen)
                 for name, t in original.items()}
        assert set(moved) <= set(actor.model.state_dict()), "the sync's names are the model's"
        probe = WeightProbe(batch[3], backend.processor, tokens=12, prompt_length=512, temperature=1.0)
        probe(actor, backend, 0, 0)
        assert probe.last.verdict == IN_SYNC, probe.last.explanation
        actor.model.load_state_dict(moved, strict=False)
        held = "language_model.layers.0."
        assert any(held in name for name in moved)
        try:
            records = [probe.last]
            for step, sync in enumerate([[], [(n, original[n] if held in n else t) for n, t in moved.items()],
                                         list(moved.items())], 1):
                if sync:
                    backend.update_weights(sync)
                probe(actor, backend, step, step)
                records.append(probe.last)
        finally:
            backend.update_weights(original.items())
        _, stale, partial, landed = records
        assert stale.verdict == STALE and abs(stale.landed_fraction) < 0.05, stale.explanation
        assert partial.verdict in self.partial_verdicts, partial.explanation
        assert landed.verdict == IN_SYNC and landed.reference_step == 0, landed.explanation


def perturbed_mergers(state: dict[str, torch.Tensor], module: str, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """The full state with only the parameters under `module` (a name fragment, e.g. Qwen3-VL's
    `.deepstack_merger_list.`) shifted (seeded)."""
    gen = torch.Generator().manual_seed(11)
    touched = {name for name in state if module in name}
    assert touched, f"no parameter named like {module!r}"
    return {name: (t + scale * torch.randn(t.shape, generator=gen) if name in touched else t.clone())
            for name, t in state.items()}


def assert_sync_changes_seen_images_like_hf(backend, hf, batch, state: dict[str, torch.Tensor], what: str,
                                            contract: EngineContract | None = None) -> None:
    """Pushing `state` (vision-side weights only) changes the backend's greedy outputs for images it has already
    seen exactly as HF's with the same weights (within `contract`'s tolerances; default float32's), leaves
    text-only requests alone, and the original weights bring the first outputs back."""
    first = backend.generate(batch, GREEDY)
    original = contract.original_state(hf) if contract is not None else clone_state(hf.model)
    backend.update_weights(state.items())
    hf.update_weights(state.items())
    try:
        after = backend.generate(batch, GREEDY)
        expected = hf.generate(batch, GREEDY)
    finally:
        hf.update_weights(original.items())
        backend.update_weights(original.items())
    (contract or EngineContract()).assert_like_hf(expected, after, backend.name, f"engine with {what} != HF with them")
    # (engines are not bitwise reproducible across batches: 1e-5 is the noise bound the contract uses)
    moved = [max(abs(a - b) for a, b in zip(x.response_logprobs, y.response_logprobs)) if x.response_ids ==
             y.response_ids else math.inf for x, y in zip(first, after)]
    assert max(moved[:3]) < 1e-5, f"text-only outputs changed although only vision weights did: {moved}"
    assert min(moved[3:]) > 1e-3, f"{what}: outputs for seen images did not change (stale vision features?): {moved}"
    restored = backend.generate(batch, GREEDY)
    assert [r.response_ids for r in restored] == [r.response_ids for r in first]


def max_drift_from_hf(hf, requests, results) -> float:
    """Largest |logprob - HF teacher-forced logprob| over these results (one per request)."""
    return max(max(abs(a - b) for a, b in zip(hf.score([r], [res.response_ids])[0], res.response_logprobs))
               for r, res in zip(requests, results))


class Qwen3VLContract(EngineContract):
    """What an engine must also show on Qwen3-VL: the deepstack mergers' weights reach it (seen images re-encode),
    and a config without `mrope_interleaved` still gives HF's outputs because vlmrl passes the setting."""

    # A variant (marker `full`, make test-all): the weights probe on the second family. make test keeps it on
    # Qwen2.5-VL (every engine) and Qwen3.5 (bfloat16, vLLM and SGLang): the same probe, the same sync paths.
    @pytest.mark.full
    def test_the_weight_probe_tells_a_stale_a_partial_and_a_landed_sync(self, backend, batch):
        super().test_the_weight_probe_tells_a_stale_a_partial_and_a_landed_sync(backend, batch)

    def test_deepstack_merger_sync_reencodes_seen_images(self, backend, hf, batch):
        state = perturbed_mergers(clone_state(hf.model), ".deepstack_merger_list.")
        assert_sync_changes_seen_images_like_hf(backend, hf, batch, state, "perturbed deepstack mergers")


def perturbed_parameters(state: dict[str, torch.Tensor], fragment: str, scale: float = 0.2,
                         seed: int = 13) -> dict[str, torch.Tensor]:
    """The full state with only the parameters whose name contains `fragment` shifted by `scale` x their spread
    (x 1 for one-element spreads), seeded."""
    gen = torch.Generator().manual_seed(seed)
    touched = {name for name in state if fragment in name}
    assert touched, f"no parameter named like {fragment!r}"
    out = {}
    for name, t in state.items():
        if name in touched:
            spread = t.float().std().item() if t.numel() > 1 else 1.0
            t = t + scale * max(spread, 0.05) * torch.randn(t.shape, generator=gen)
        out[name] = t.clone()
    return out


LINEAR_ATTENTION_TENSORS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "conv1d", "A_log",
                            "dt_bias", "linear_attn.norm")
"""Every parameter kind of a Qwen3.5 Gated DeltaNet layer (engines fuse some of them: vLLM in_proj_qkv + in_proj_z
and in_proj_b + in_proj_a, SGLang the same), each of which a weight sync must deliver."""


class Qwen3_5Contract(EngineContract):
    """The contract in bfloat16, Qwen3.5's only dtype on CPU engines (vLLM's GDN kernel asserts it), against HF in
    bfloat16 (HF float32 and bfloat16 split from the 3rd-4th token on: a float32 reference would compare dtypes, not
    implementations). Greedy ids may split, only at a near-tie: both tokens in each other's top-5 and within
    bfloat16's noise (`BF16_LOGPROB_TOL`) on both sides, and the logprobs before the split within that noise: a rule
    for any prompt, so no count of requests must be equal outright (on 8 other prompts vLLM was exact on none, every
    split such a near-tie). Also: every linear-attention tensor reaches the engine."""

    logprob_tol = tie_tol = BF16_LOGPROB_TOL
    favoured_logprob_tol = 1.25
    """With the pad token pushed to hold almost all the mass, the tokens sampled in its place have raw logprobs of
    -4 to -22 nats, computed from bfloat16 logits that resolve 0.1-0.25 at that size, and the ban correction adds
    back the pad's mass (SGLang) from such logits too: measured at strength 4, the largest |engine - HF| is 0.64
    (vLLM) and 0.93 (SGLang). Without the correction the error would be the pad's whole mass (several nats)."""
    ties_allowed = True
    min_buckets = 8  # the bfloat16 tiny Qwen3.5 is 2.4 MB
    probe_scale = 0.3
    """A bfloat16 engine sits ~0.1 nats from a float32 trainer on the probe, so the trainer must move ~10x that
    before the probe resolves how much of a sync landed (0.02 moves it 0.5 nats)."""
    partial_verdicts = ("partial", "differs")
    """A move that large changes the greedy tokens, and with them gone the probe judges the gap alone (`differs`)."""
    favour_strength = 4.0  # the pad token the top pick on 6 of the 9 prompts at 3.0, on all 9 from 4.0

    def original_state(self, hf) -> dict[str, torch.Tensor]:
        """The checkpoint's float32 tensors, not the bfloat16 reference's: vLLM keeps linear_attn.A_log in float32,
        and a restore from the rounded copy would leave the engine on other weights than it loaded (a test then
        passes only after another one has already rounded it)."""
        return float32_checkpoint(hf.model_path)

    def test_sampled_logprobs_drift_like_bfloat16_on_average(self, backend, hf, batch):
        """The mean |engine - HF| over sampled tokens stays at bfloat16's level (`BF16_MEAN_LOGPROB_TOL`): a
        setting that changed the computation (a mis-set rope, another layer type) moves the mean long before the
        largest token crosses the per-token bound."""
        results = backend.generate(batch, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=5))
        diffs = [abs(a - b) for j, request in enumerate(batch) for r in results[2 * j:2 * j + 2]
                 for a, b in zip(hf.score([request], [r.response_ids])[0], r.response_logprobs)]
        assert sum(diffs) / len(diffs) < BF16_MEAN_LOGPROB_TOL, f"mean |dlogprob| {sum(diffs) / len(diffs):.3f}"

    def test_every_linear_attention_tensor_lands(self, backend, hf, batch):
        """Each kind of Gated DeltaNet parameter pushed alone (both layers) changes the engine's logprobs on text
        prompts; all of them pushed together give HF's outputs with the same weights; the originals bring back the
        first outputs exactly."""
        requests = batch[:3] + batch[3:4]  # text only (no vision weight involved) and one image
        one = SamplingParams(temperature=0.0, max_new_tokens=4, top_logprobs=5)
        original = self.original_state(hf)
        # the bfloat16 reference's weights first: an earlier test may have left the float32 trainer's in the engine,
        # whose linear_attn.A_log (kept in float32 by vLLM) then differs from the bfloat16 copy restored below
        backend.update_weights(original.items())
        first = backend.generate(requests, one)
        unmoved = []
        try:
            for kind in LINEAR_ATTENTION_TENSORS:
                backend.update_weights(perturbed_parameters(original, f".{kind}").items())
                after = backend.generate(requests, one)
                moved = max(abs(x.response_logprobs[0] - y.response_logprobs[0]) for x, y in zip(first, after))
                if moved < 1e-3:
                    unmoved.append(f"{kind} ({moved:.1e})")
            assert not unmoved, f"pushing these linear-attention tensors changed nothing: {unmoved}"
            every = original
            for kind in LINEAR_ATTENTION_TENSORS:
                every = perturbed_parameters(every, f".{kind}")
            backend.update_weights(every.items())
            hf.update_weights(every.items())
            self.assert_like_hf(hf.generate(batch, GREEDY), backend.generate(batch, GREEDY), backend.name,
                                "engine with every linear-attention tensor perturbed != HF with them")
        finally:
            hf.update_weights(original.items())
            backend.update_weights(original.items())
        restored = backend.generate(requests, one)
        assert [r.response_ids for r in restored] == [r.response_ids for r in first]
        assert all(x.response_logprobs == y.response_logprobs for x, y in zip(first, restored))


class Qwen3_5VideoContract:
    """Qwen3.5 videos (Qwen3-VL's `<x.x seconds>` layout) through an engine that takes them (not sglang-server):
    a video request and an image + video request give HF bfloat16's greedy tokens (up to a near-tie) at 2 and 24
    fps, and the fps reaches the engine."""

    @pytest.mark.parametrize("fps", [2.0, 24.0])
    def test_video_greedy_like_hf(self, backend, hf, tiny_model_path, fps):
        from tests.rollout.video_helpers import video_batch

        requests = [video_batch(tiny_model_path, fps)[i] for i in (0, 6)]
        ref, got = hf.generate(requests, GREEDY), backend.generate(requests, GREEDY)
        problems = greedy_problems(ref, got, backend.name, BF16_LOGPROB_TOL, BF16_LOGPROB_TOL, ties_allowed=True)
        assert not problems, "\n".join(problems)

    def test_the_fps_reaches_the_engine(self, backend, tiny_model_path):
        from tests.rollout.video_helpers import video_batch

        slow, fast = video_batch(tiny_model_path, 2.0)[0], video_batch(tiny_model_path, 24.0)[0]
        one = SamplingParams(temperature=0.0, max_new_tokens=1, top_logprobs=3)
        a, b = backend.generate([slow], one)[0], backend.generate([fast], one)[0]
        assert a.top_logprobs[0] != b.top_logprobs[0]
