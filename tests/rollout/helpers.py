"""Shared pieces of the rollout tests: the request batch, weight edits, comparisons, and the contract every engine
backend is tested against (`EngineContract`, subclassed once per engine module with its own started engine)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from PIL import Image

from vlmrl.rollout import InvalidRequestError, RolloutBackend
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, top_logprobs=5)
LOGPROB_TOL = 1e-4
"""Sampled-token logprobs vs HF teacher-forced, fp32: measured <= 5e-6 on both engines; 20x headroom."""
FAVOURED_LOGPROB_TOL = 2e-3
"""Same, when a banned token holds almost all the mass: SGLang's ban correction reads the banned logprob at a
-1e4 offset, where float32 resolves ~1e-3 (see vlmrl.rollout.sglang)."""


def sglang_server(model_path: str, tmp_path_factory, label: str, **options):
    """A module fixture's body: an fp32 `sglang-server` launched on the model, its log in a fresh temporary folder
    named `label` (read by the tests that check what the server said); yields the started backend, stops it after."""
    from vlmrl.rollout import get_backend

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
    return {name: (t + scale * torch.randn(t.shape, generator=gen) if ".visual." in f".{name}" else t.clone())
            for name, t in state.items()}


@torch.no_grad()
def favouring(hf, requests: list[RolloutRequest], token_id: int, strength: float = 3.0) -> dict[str, torch.Tensor]:
    """The full state with lm_head's row for `token_id` pointed along the mean final hidden state of these
    prompts: that token then out-scores every other one by several nats (checked by the caller)."""
    hidden = torch.cat([hf.model(**hf._model_inputs(r), output_hidden_states=True).hidden_states[-1][0]
                        for r in requests])
    direction = hidden.mean(0) / hidden.mean(0).norm()
    state = clone_state(hf.model)
    state["lm_head.weight"][token_id] = strength * direction
    return state


def without_ban(request: RolloutRequest) -> RolloutRequest:
    return dataclasses.replace(request, banned_token_ids=[])


def greedy_mismatch(ref: RolloutResult, got: RolloutResult, backend: str) -> str | None:
    """None when the greedy ids are equal, else where they first differ and whether it is a near-tie (both tokens
    within the other's top-5 and |dlogp| < 1e-3 on either side) - the message a failing assertion shows."""
    if ref.response_ids == got.response_ids:
        return None
    pos = next((i for i, (a, b) in enumerate(zip(ref.response_ids, got.response_ids)) if a != b),
               min(len(ref.response_ids), len(got.response_ids)))
    if pos >= min(len(ref.response_ids), len(got.response_ids)):
        return f"{ref.uid}: lengths differ ({len(ref.response_ids)} hf vs {len(got.response_ids)} {backend})"
    a, b = ref.response_ids[pos], got.response_ids[pos]
    top_ref, top_got = ref.top_logprobs[pos], got.top_logprobs[pos]
    tie = (b in top_ref and a in top_got
           and abs(top_ref[a] - top_ref[b]) < 1e-3 and abs(top_got[a] - top_got[b]) < 1e-3)
    return (f"{ref.uid}: first divergence at token {pos}: hf {a} vs {backend} {b} "
            f"({'near-tie' if tie else 'NOT a near-tie'}; hf top-5 {top_ref}, {backend} top-5 {top_got})")


def is_near_tie_or_equal(ref: RolloutResult, got: RolloutResult, backend: str) -> bool:
    message = greedy_mismatch(ref, got, backend)
    return message is None or "(near-tie" in message


def assert_logprobs_match_hf(hf, requests, results, n: int, tol: float, backend: str) -> float:
    """Every sample's logprobs equal HF's teacher-forced raw logprobs of the same tokens within tol; the largest
    difference is returned."""
    worst = 0.0
    for j, request in enumerate(requests):
        for result in results[j * n:(j + 1) * n]:
            reference = hf.score(request, result.response_ids)
            diff = max(abs(a - b) for a, b in zip(reference, result.response_logprobs))
            assert diff <= tol, (f"{backend}: request {j} sample {result.sample_index}: logprobs differ from HF "
                                 f"teacher-forced by {diff:.2e} > {tol:g}\n{backend}: {result.response_logprobs}\n"
                                 f"hf: {reference}")
            worst = max(worst, diff)
    return worst


class EngineContract:
    """The behaviour every engine backend must show (the rollout contract). Subclass in a test module that provides the
    fixtures `backend` (module-scoped, started once) and uses the shared `hf`, `batch` and `hf_greedy`."""

    def test_greedy_equals_hf_fp32(self, backend: RolloutBackend, batch, hf_greedy):
        """Nine requests with 0, 1 and 2 images of different sizes: the same ids as HF, token for token (fp32)."""
        results = backend.generate(batch, GREEDY)
        assert [r.uid for r in results] == [r.uid for r in batch]
        problems = [m for ref, got in zip(hf_greedy, results) if (m := greedy_mismatch(ref, got, backend.name))]
        assert not problems, "\n".join(problems)
        for ref, got in zip(hf_greedy, results):
            assert got.finish_reason == ref.finish_reason
            assert max(abs(a - b) for a, b in zip(ref.response_logprobs, got.response_logprobs)) < LOGPROB_TOL
            assert list(got.top_logprobs[0]) == list(ref.top_logprobs[0]), "top-5 ranking differs at token 0"

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
        assert_logprobs_match_hf(hf, batch, results, 4, LOGPROB_TOL, backend.name)

    def test_stop_token_ends_response(self, backend, batch, hf_greedy):
        """An extra stop token ends the response right after it (kept), with finish_reason 'stop'."""
        reference = hf_greedy[3].response_ids
        position = next(i for i in range(2, len(reference)) if reference[i] not in reference[:i])
        sampling = dataclasses.replace(GREEDY, stop_token_ids=[reference[position]])
        (result,) = backend.generate([batch[3]], sampling)
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
        original = clone_state(hf.model)
        favoured = favouring(hf, batch, pad)
        hf.update_weights(favoured.items())
        try:
            unbanned = hf.generate([without_ban(r) for r in batch], SamplingParams(temperature=0.0, max_new_tokens=1))
            assert all(r.response_ids == [pad] for r in unbanned), "the setting does not favour the pad token"
            backend.update_weights(favoured.items())
            some = batch[::2]  # 0, 1 and 2 images; unbanned, nearly every one of these draws would be the pad token
            results = backend.generate(some, SamplingParams(n=2, temperature=1.0, max_new_tokens=6))
            assert all(pad not in r.response_ids for r in results)
            assert_logprobs_match_hf(hf, some, results, 2, FAVOURED_LOGPROB_TOL, backend.name)
        finally:
            hf.update_weights(original.items())
            backend.update_weights(original.items())

    def test_weight_sync_lands_and_restores(self, backend, hf, batch):
        """Perturbed vision-tower weights change the outputs for images the engine has already seen (no stale
        embeddings), exactly as HF with the same weights; the originals bring back the very first outputs."""
        first = backend.generate(batch, GREEDY)
        original = clone_state(hf.model)
        perturbed = perturbed_vision(original)
        backend.update_weights(perturbed.items())
        hf.update_weights(perturbed.items())
        try:
            after = backend.generate(batch, GREEDY)
            expected = hf.generate(batch, GREEDY)
        finally:
            hf.update_weights(original.items())
        problems = [m for ref, got in zip(expected, after) if (m := greedy_mismatch(ref, got, backend.name))]
        assert not problems, "engine with perturbed weights != HF with them:\n" + "\n".join(problems)
        changed = [a.response_ids != b.response_ids for a, b in zip(first, after)]
        assert not any(changed[:3]), "text-only outputs changed although only the vision tower did"
        assert sum(changed[3:]) >= 4, f"outputs for seen images barely changed: {changed}"
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
        original = clone_state(hf.model)
        gen = torch.Generator().manual_seed(11)
        shifted = {name: t + 0.02 * t.std() * torch.randn(t.shape, generator=gen) for name, t in original.items()}
        sizes = (backend.rollout.sync_bucket_mb, hf.rollout.sync_bucket_mb)
        backend.rollout.sync_bucket_mb = hf.rollout.sync_bucket_mb = 0.25
        try:
            assert len(list(backend.sync_plan(shifted.items()).buckets)) >= 10
            backend.update_weights(shifted.items())
            hf.update_weights(shifted.items())
            try:
                after = backend.generate(batch, GREEDY)
                expected = hf.generate(batch, GREEDY)
            finally:
                hf.update_weights(original.items())
            problems = [m for ref, got in zip(expected, after) if (m := greedy_mismatch(ref, got, backend.name))]
            assert not problems, "engine with bucketed weights != HF with them:\n" + "\n".join(problems)
            assert sum(a.response_ids != b.response_ids for a, b in zip(first, after)) >= len(batch) // 2
            backend.update_weights(original.items())
        finally:
            backend.rollout.sync_bucket_mb, hf.rollout.sync_bucket_mb = sizes
        restored = backend.generate(batch, GREEDY)
        assert [r.response_ids for r in restored] == [r.response_ids for r in first]

def perturbed_mergers(state: dict[str, torch.Tensor], module: str, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """The full state with only the parameters under `module` (a name fragment, e.g. Qwen3-VL's
    `.deepstack_merger_list.`) shifted (seeded)."""
    gen = torch.Generator().manual_seed(11)
    touched = {name for name in state if module in name}
    assert touched, f"no parameter named like {module!r}"
    return {name: (t + scale * torch.randn(t.shape, generator=gen) if name in touched else t.clone())
            for name, t in state.items()}


def assert_sync_changes_seen_images_like_hf(backend, hf, batch, state: dict[str, torch.Tensor], what: str) -> None:
    """Pushing `state` (vision-side weights only) changes the backend's greedy outputs for images it has already
    seen exactly as HF's with the same weights, leaves text-only requests alone, and the original weights bring the
    first outputs back."""
    first = backend.generate(batch, GREEDY)
    original = clone_state(hf.model)
    backend.update_weights(state.items())
    hf.update_weights(state.items())
    try:
        after = backend.generate(batch, GREEDY)
        expected = hf.generate(batch, GREEDY)
    finally:
        hf.update_weights(original.items())
        backend.update_weights(original.items())
    problems = [m for ref, got in zip(expected, after) if (m := greedy_mismatch(ref, got, backend.name))]
    assert not problems, f"engine with {what} != HF with them:\n" + "\n".join(problems)
    assert all(max(abs(a - b) for a, b in zip(ref.response_logprobs, got.response_logprobs)) < LOGPROB_TOL
               for ref, got in zip(expected, after))
    # (engines are not bitwise reproducible across batches: 1e-5 is the noise bound the contract uses)
    moved = [max(abs(a - b) for a, b in zip(x.response_logprobs, y.response_logprobs)) if x.response_ids ==
             y.response_ids else math.inf for x, y in zip(first, after)]
    assert max(moved[:3]) < 1e-5, f"text-only outputs changed although only vision weights did: {moved}"
    assert min(moved[3:]) > 1e-3, f"{what}: outputs for seen images did not change (stale vision features?): {moved}"
    restored = backend.generate(batch, GREEDY)
    assert [r.response_ids for r in restored] == [r.response_ids for r in first]


def max_drift_from_hf(hf, requests, results) -> float:
    """Largest |logprob - HF teacher-forced logprob| over these results (one per request)."""
    return max(max(abs(a - b) for a, b in zip(hf.score(r, res.response_ids), res.response_logprobs))
               for r, res in zip(requests, results))


class Qwen3VLContract(EngineContract):
    """What an engine must also show on Qwen3-VL: the deepstack mergers' weights reach it (seen images re-encode),
    and a config without `mrope_interleaved` still gives HF's outputs because vlmrl passes the setting."""

    def test_deepstack_merger_sync_reencodes_seen_images(self, backend, hf, batch):
        state = perturbed_mergers(clone_state(hf.model), ".deepstack_merger_list.")
        assert_sync_changes_seen_images_like_hf(backend, hf, batch, state, "perturbed deepstack mergers")
