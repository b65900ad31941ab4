"""Engine-free parts of vlmrl.rollout: request checks, the deadline runner, the registry, weight names, and the
arithmetic that undoes SGLang's renormalisation over non-banned tokens."""

from __future__ import annotations

import dataclasses
import doctest
import json
import math
import subprocess
import sys
import threading
from dataclasses import replace

import pytest
import torch

from tests.rollout.helpers import GREEDY, noise_image
from vlmrl.models import families
from vlmrl.models.families import QWEN2_5_VL, QWEN3_VL
from vlmrl.rollout import base, weights
from vlmrl.rollout.base import BackendOptions, DeadlineRunner, RolloutBackend
from vlmrl.rollout.errors import EngineDeadError, EngineTimeoutError, InvalidRequestError, RolloutError
from vlmrl.rollout.registry import get_backend
from vlmrl.rollout.requests import finish_at_stop, top_allowed
from vlmrl.rollout.weights import weight_sync
from vlmrl.types import RolloutRequest, RolloutResult, SamplingParams

# ---------------------------------------------------------------------------------------------- request checks


def test_placeholder_image_mismatch_names_the_request(hf, batch):
    bad = dataclasses.replace(batch[7], uid="u-bad", images=batch[7].images[:1])
    named = r"request 1 \(uid u-bad, dataset row 7\): 2 <\|image_pad\|>.*1 images"
    with pytest.raises(InvalidRequestError, match=named):
        hf.check_requests([batch[0], bad], GREEDY)


@pytest.mark.parametrize("change, message", [
    (lambda r, p: dataclasses.replace(r, images=[noise_image(100, 112, 0)]), "image 0 is RGB 100x112"),
    (lambda r, p: dataclasses.replace(r, images=[r.images[0].convert("L")]), "image 0 is L"),
    (lambda r, p: dataclasses.replace(r, prompt_ids=r.prompt_ids + [p.video_token_id]), "video_pad"),
    (lambda r, p: dataclasses.replace(r, prompt_ids=[]), "empty prompt"),
    (lambda r, p: dataclasses.replace(r, prompt_ids=r.prompt_ids + [30] * 1000),
     r"prompt of 1\d\d\d tokens \(expanded\) \+ max_new_tokens=12 > max_model_len=1024"),
])
def test_requests_no_engine_may_see_are_refused(hf, batch, change, message):
    with pytest.raises(InvalidRequestError, match=message):
        hf.check_requests([change(batch[3], hf.processor)], GREEDY)


@pytest.mark.parametrize("sampling", [SamplingParams(n=0), SamplingParams(top_k=0), SamplingParams(top_p=0.0),
                                      SamplingParams(temperature=-1.0), SamplingParams(max_new_tokens=0)])
def test_bad_sampling_settings_are_refused(hf, batch, sampling):
    with pytest.raises(InvalidRequestError, match="invalid sampling settings"):
        hf.check_requests(batch[:1], sampling)


def test_too_many_images_for_limit_images(tiny_model_path, batch):
    with get_backend("hf", tiny_model_path, limit_images=1) as backend:
        with pytest.raises(InvalidRequestError, match="2 images > limit_images=1"):
            backend.generate(batch[6:7], GREEDY)


# ---------------------------------------------------------------------------------------------- deadlines


def test_deadline_expiry_raises_timeout_then_every_call_fails_at_once():
    runner = DeadlineRunner("fake", poll_s=0.05)
    release = threading.Event()
    with pytest.raises(EngineTimeoutError, match="^fake: generate did not finish within 0.2 s"):
        runner.call("generate", release.wait, timeout_s=0.2)
    with pytest.raises(EngineDeadError, match="^fake: cannot generate: the engine is unusable"):
        runner.call("generate", lambda: 1, timeout_s=5)
    release.set()


def test_a_death_seen_while_waiting_fails_the_call_before_its_deadline():
    """The stuck call (a dead SGLang scheduler never answers) is abandoned as soon as health() reports the death."""
    dead = threading.Event()
    runner = DeadlineRunner("fake", health=lambda: "process 123 exited" if dead.is_set() else None, poll_s=0.05)
    threading.Timer(0.2, dead.set).start()
    with pytest.raises(EngineDeadError, match="^fake: cannot generate: process 123 exited"):
        runner.call("generate", threading.Event().wait, timeout_s=600)


def test_engine_exceptions_are_wrapped_with_the_backend_name():
    runner = DeadlineRunner("fake")
    with pytest.raises(RolloutError, match="^fake: load failed: KeyError: 'x'") as info:
        runner.call("load", lambda: {}["x"], timeout_s=5)
    assert isinstance(info.value.__cause__, KeyError)
    assert runner.call("add", lambda: 1 + 1, timeout_s=5) == 2  # an engine error is not a dead engine


# ---------------------------------------------------------------------------------------------- registry


def test_unknown_backend_and_unknown_option_say_what_exists(tiny_model_path):
    with pytest.raises(ValueError, match=r"unknown rollout backend 'vlm'.*'sglang-server'"):
        get_backend("vlm", tiny_model_path)
    with pytest.raises(TypeError, match=r"vllm: unknown option\(s\) \['gpu_mem'\].*gpu_memory_utilization"):
        get_backend("vllm", tiny_model_path, gpu_mem=0.5)


class _Broken(RolloutBackend):
    """A backend whose engine call returns what `broken` makes of correct results: a broken engine (or a new
    backend's bug) that no real engine here can be made to produce on demand."""

    name = "broken"

    def __init__(self, model_path, broken):
        super().__init__(model_path, BackendOptions(max_model_len=1024))
        self.broken, self.calls = broken, 0

    def _generate(self, requests, sampling):
        self.calls += 1
        results = [RolloutResult(uid=r.uid, sample_index=i, response_ids=[5, 6], response_logprobs=[-1.0, -2.0],
                                 finish_reason="length", top_logprobs=[{5: -1.0}, {6: -2.0}])
                   for r in requests for i in range(sampling.n)]
        return self.broken(results, requests)

    def _update_weights(self, named_tensors, names):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("broken, message", [
    (lambda results, requests: results[:-1], r"3 results for 2 requests x n=2"),
    (lambda results, requests: results[1:] + results[:1], r"request 0 .* sample 0: result is uid .* sample 1"),
    (lambda results, requests: [replace(results[0], response_logprobs=[-1.0])] + results[1:], r"1 logprobs for 2"),
    (lambda results, requests: [replace(results[0], finish_reason="eos")] + results[1:], r"finish_reason 'eos'"),
    (lambda results, requests: [replace(results[0], response_ids=[requests[0].banned_token_ids[0], 6])] + results[1:],
     r"contains banned token"),
])
def test_every_backend_gets_the_result_checks(tiny_model_path, batch, broken, message):
    """generate() is the base class's: whatever a backend's own _generate returns is checked before a caller sees
    it, so a new backend cannot skip a check."""
    backend = _Broken(tiny_model_path, broken)
    with pytest.raises(RolloutError, match=message):
        backend.generate(batch[:2], SamplingParams(n=2, max_new_tokens=4, top_logprobs=1))
    assert backend.calls == 1
    with pytest.raises(InvalidRequestError):  # and the request checks before it: the engine is not called
        backend.generate([replace(batch[0], prompt_ids=[])], SamplingParams(max_new_tokens=4))
    assert backend.calls == 1


def test_importing_the_registry_and_backend_modules_imports_no_engine():
    code = ("import sys, vlmrl.rollout.registry as r\n"
            "for name in r.BACKENDS: r.backend_class(name)\n"
            "print(sorted(m for m in ('vllm', 'sglang') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------------------------------------- pure helpers


def test_checkpoint_names_follow_the_family():
    """Weight sync renames transformers-5 names into the layout each family's engines load: Qwen2.5-VL's
    checkpoints flatten the nesting, Qwen3-VL's keep it (vLLM's Qwen3-VL loader has no rule for the flat one)."""
    name = QWEN2_5_VL.weights.checkpoint_name
    assert name("model.language_model.layers.1.mlp.up_proj.bias") == "model.layers.1.mlp.up_proj.bias"
    assert name("model.visual.merger.mlp.0.weight") == "visual.merger.mlp.0.weight"
    assert name("model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert name("lm_head.weight") == "lm_head.weight"
    for name in ("model.language_model.layers.1.mlp.up_proj.bias", "model.visual.deepstack_merger_list.0.norm.weight",
                 "model.visual.merger.linear_fc1.weight", "lm_head.weight"):
        assert QWEN3_VL.weights.checkpoint_name(name) == name
    merger = "model.visual.merger.linear_fc1.weight"
    for family, name, key in ((QWEN3_VL, merger, merger),
                              (QWEN2_5_VL, "model.visual.merger.mlp.0.weight", "visual.merger.mlp.0.weight")):
        sync = weight_sync([(name, torch.ones(1))], None, set(), None, 0, "test", family)
        assert sync.names == {key} and [list(b) for b in sync.buckets] == [[key]]
    with pytest.raises(ValueError, match="given twice"):  # two in-memory names, one checkpoint name
        weight_sync([("model.language_model.norm.weight", torch.ones(1)), ("model.norm.weight", torch.ones(1))],
                    None, set(), None, 0, "test", QWEN2_5_VL)
    with pytest.raises(ValueError, match="got no tensors"):
        weight_sync([], None, set(), None, 0, "test", QWEN2_5_VL)


@pytest.mark.parametrize("module", [families, base, weights])
def test_doctests(module):
    failures, tried = doctest.testmod(module)
    assert tried and not failures


def test_qwen3_vl_config_without_interleaving_gets_it_as_an_engine_override(tmp_path):
    """The embedded Qwen3-VL carries mrope_interleaved (nothing to override); a copy without it is named as a
    problem and gets the whole rope dict back with the flag set (SGLang replaces sub-dicts rather than merging)."""
    from vlmrl.models.tiny import ensure_built

    source = ensure_built("tiny-qwen3-vl")
    config = families.read_model_config(source)
    assert QWEN3_VL.engine_problems(config) == [] and QWEN3_VL.engine_overrides(config) == {}
    rope = dict(config["text_config"]["rope_parameters"])
    del config["text_config"]["rope_parameters"]["mrope_interleaved"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert "mrope_interleaved" in QWEN3_VL.engine_problems(config)[0]
    assert base.family_engine_overrides(str(tmp_path), QWEN3_VL, True, "test") == {
        "text_config": {"rope_parameters": rope}, "rope_parameters": rope}
    assert base.family_engine_overrides(str(tmp_path), QWEN3_VL, False, "test") == {}
    assert base.family_engine_overrides(str(source), QWEN3_VL, True, "test") == {}


def test_finish_at_stop_and_top_allowed():
    assert finish_at_stop([5, 6, 2, 7, 2], {2}) == ([5, 6, 2], "stop")
    assert finish_at_stop([5, 6], {2}) == ([5, 6], "length")
    assert top_allowed({1: -1.0, 2: -0.5, 3: -2.0, 4: -0.1}, 2, banned=[4]) == {2: -0.5, 1: -1.0}


def test_sglang_ban_renormalisation_is_undone_exactly():
    """SGLang computes logprobs after its logit bias; from the banned tokens' biased logprobs the raw log_softmax
    over the whole vocabulary is restored, even when a banned token holds almost all the mass."""
    from vlmrl.rollout.sglang import BAN_LOGIT_BIAS, _result

    logits = torch.randn(3, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    logits[:, 7] += 25.0  # banned token 7 dominates
    raw = torch.log_softmax(logits, -1)
    biased = logits.clone()
    biased[:, [7, 9]] += BAN_LOGIT_BIAS
    seen = torch.log_softmax(biased.float(), -1).double()  # what SGLang returns (float32)
    ids = [3, 11, 40]
    out = {"output_ids": ids, "meta_info": {
        "output_token_logprobs": [[seen[p, t].item(), t, None] for p, t in enumerate(ids)],
        "output_token_ids_logprobs": [[[seen[p, b].item(), b, None] for b in (7, 9)] for p in range(3)],
        "output_top_logprobs": [[[seen[p, t].item(), t, None] for t in seen[p].topk(4).indices.tolist()]
                                for p in range(3)],
        "finish_reason": {"type": "length", "length": 3}}}
    request = RolloutRequest(uid="u", prompt_ids=[1], banned_token_ids=[7, 9])
    result = _result(out, request, 0, top_k=2)
    expected = [raw[p, t].item() for p, t in enumerate(ids)]
    assert max(abs(a - b) for a, b in zip(result.response_logprobs, expected)) < 2e-3
    assert result.response_logprobs[0] < -20  # the naive (renormalised) value would be about -4
    assert not math.isclose(result.response_logprobs[0], seen[0, 3].item(), abs_tol=1.0)
    for p, top in enumerate(result.top_logprobs):
        assert list(top) == [t for t in raw[p].argsort(descending=True).tolist() if t not in (7, 9)][:2]
    assert result.finish_reason == "length"


# ---- bucketed weight sync (rollout.sync_bucket_mb) -----------------------------------------------------------------


def _named(sizes: list[int], dtype=torch.float32) -> list[tuple[str, torch.Tensor]]:
    return [(f"model.language_model.layers.{i}.mlp.up_proj.weight", torch.full((n,), float(i), dtype=dtype))
            for i, n in enumerate(sizes)]


def test_buckets_hold_at_most_the_bucket_size_but_for_a_larger_tensor_alone():
    named = _named([100, 100, 300, 50, 50, 50])  # float32: 400, 400, 1200, 200, 200, 200 bytes
    sync = weight_sync(named, None, set(), torch.float32, bucket_bytes=800, backend="test",
                       family=QWEN2_5_VL)
    buckets = list(sync.buckets)
    assert [len(b) for b in buckets] == [2, 1, 3]  # the 1200-byte tensor alone
    assert [k for b in buckets for k in b] == [f"model.layers.{i}.mlp.up_proj.weight" for i in range(6)]
    assert sync.names == {k for b in buckets for k in b}


def test_buckets_are_cast_to_the_engine_dtype_and_read_lazily():
    named = _named([10, 10, 10])
    read: list[str] = []

    def stream():
        for name, tensor in named:
            read.append(name)
            yield name, tensor

    sync = weight_sync(stream(), [n for n, _ in named], set(), torch.bfloat16, bucket_bytes=20, backend="test",
                       family=QWEN2_5_VL)
    assert read == []  # names come first; nothing gathered yet
    first = next(sync.buckets)
    assert len(read) <= 2 and all(t.dtype == torch.bfloat16 for t in first.values())


def test_a_stream_that_differs_from_its_announced_names_is_refused():
    named = _named([4, 4])
    sync = weight_sync(iter(named), [named[1][0], named[0][0]], set(), None, 0, "test", QWEN2_5_VL)
    with pytest.raises(ValueError, match="not the announced"):
        list(sync.buckets)


def test_an_untied_copy_is_refused_in_a_stream_even_buckets_apart():
    embed = torch.randn(8, 4)
    named = [("model.language_model.embed_tokens.weight", embed), *_named([64, 64]), ("lm_head.weight", embed + 1)]
    model_names = {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                   "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="ties lm_head.weight to model.embed_tokens.weight"):  # values at hand
        weight_sync(named, None, model_names, None, 256, "test", QWEN2_5_VL)
    sync = weight_sync(iter(named), [n for n, _ in named], model_names, None, 256, "test", QWEN2_5_VL)
    assert sync.names == model_names
    with pytest.raises(ValueError, match="ties lm_head.weight to model.embed_tokens.weight"):
        list(sync.buckets)
    tied = [*named[:-1], ("lm_head.weight", embed.clone())]
    buckets = list(weight_sync(iter(tied), [n for n, _ in tied], model_names, None, 256, "test",
                               QWEN2_5_VL).buckets)
    assert len(buckets) > 1 and "lm_head.weight" not in {k for b in buckets for k in b}


def test_synced_tensors_are_detached_contiguous_cpu_copies_of_what_was_given():
    weight = torch.arange(12.0).reshape(3, 4).t().requires_grad_()  # a transposed view: not contiguous
    (bucket,) = weight_sync([("model.norm.weight", weight)], None, set(), None, 0, "test", QWEN2_5_VL).buckets
    sent = bucket["model.norm.weight"]
    assert sent.is_contiguous() and not sent.requires_grad and sent.device.type == "cpu"
    assert torch.equal(sent, weight.detach())


EMBED_KEY = "model.embed_tokens.weight"


@pytest.mark.parametrize("model_names, shift, sent", [
    ({EMBED_KEY}, 0.0, {EMBED_KEY}),  # tied checkpoint: the equal copy is left out
    ({EMBED_KEY, "lm_head.weight"}, 0.0, {EMBED_KEY, "lm_head.weight"}),  # untied checkpoint: both go
    ({EMBED_KEY, "lm_head.weight"}, 1.0, {EMBED_KEY, "lm_head.weight"}),  # ... and may differ
    (set(), 1.0, {EMBED_KEY, "lm_head.weight"}),  # the model's names unknown: everything goes, unchecked
], ids=["tied", "untied-checkpoint-equal", "untied-checkpoint-different", "unknown-names"])
def test_a_tied_copy_is_left_out_only_where_the_checkpoint_lacks_it(model_names, shift, sent):
    """The cases of the checkpoint_state + drop_tied_copies pair that weight_sync replaced, with the values at hand
    and as a stream (a differing copy of a tied checkpoint: test_an_untied_copy_is_refused_...)."""
    embed = torch.randn(8, 4)
    named = [("model.language_model.embed_tokens.weight", embed), ("lm_head.weight", embed + shift)]
    for names in (None, [n for n, _ in named]):
        sync = weight_sync(named if names is None else iter(named), names, model_names, None, 0, "test", QWEN2_5_VL)
        (bucket,) = sync.buckets
        assert sync.names == set(bucket) == sent
        assert torch.equal(bucket[EMBED_KEY], embed)
        if "lm_head.weight" in sent:
            assert torch.equal(bucket["lm_head.weight"], embed + shift)


def test_qwen3_vl_ties_in_its_own_checkpoint_names():
    """Qwen3-VL's checkpoints keep the nesting: its tied copy is dropped, and an untied one refused, under
    model.language_model.embed_tokens.weight."""
    embed = torch.randn(8, 4)
    model_names = {"model.language_model.embed_tokens.weight"}
    named = [("model.language_model.embed_tokens.weight", embed), ("lm_head.weight", embed.clone())]
    assert weight_sync(named, None, model_names, None, 0, "test", QWEN3_VL).names == model_names
    with pytest.raises(ValueError, match="ties lm_head.weight to model.language_model.embed_tokens.weight"):
        weight_sync([named[0], ("lm_head.weight", embed + 1)], None, model_names, None, 0, "test", QWEN3_VL)
