"""Chunked logprobs/entropy (actor.logprob_chunk_size) equal the unchunked pass on the tiny Qwen2.5-VL: values,
entropy and gradients, for rows with and without images and for padding rows, whatever the chunk."""

from __future__ import annotations

import pytest
import torch

from tests.batches import make_batch
from vlmrl.actor.forward import forward_response, micro_batch
from vlmrl.actor.local import Actor
from vlmrl.batch.padding import upsample_to_multiple
from vlmrl.config import ActorConfig, OptimConfig


@pytest.fixture(scope="module")
def model(tiny_model_path):
    config = ActorConfig(model_path=tiny_model_path, optim=OptimConfig(lr=1e-3, weight_decay=0.0), device="cpu",
                         dtype="float32")
    return Actor(config, total_steps=1, mini_batch_samples=8).model


@pytest.fixture(scope="module")
def batch(processor, synthetic_rows):
    # 3 prompts x 2 samples, prompt 1 text-only, upsampled with 2 padding rows: image, plain and padding rows
    plain = make_batch(processor, synthetic_rows[:3], n=2, text_only_rows=(1,))
    padded = upsample_to_multiple(plain, 8, eos_token_id=processor.eos_token_ids[0],
                                  pad_token_id=processor.pad_token_id)
    assert int(padded.is_padding.sum()) == 2 and any(padded.multi_modal_inputs) and not all(padded.multi_modal_inputs)
    return padded


def _pass(model, batch, chunk: int, entropy_grad: bool, temperature: float = 0.7):
    """Logprobs, entropy and the gradient of (logprob sum + entropy sum over response tokens) for every weight."""
    model.zero_grad(set_to_none=True)
    mb = micro_batch(batch, range(len(batch)), torch.device("cpu"))
    logprobs, entropy = forward_response(model, mb, temperature, True, entropy_grad, chunk=chunk)
    mask = batch.response_mask[:, : mb.response_width].to(logprobs.dtype)
    loss = (logprobs * mask).sum() + ((entropy * mask).sum() if entropy_grad else 0.0)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy.detach(), grads, mb.response_width


CHUNKS = (1, 7, 64, 10_000)  # one token, uneven chunks, several rows per chunk, more than the micro-batch has


def test_chunked_values_equal_the_unchunked_ones_in_float32(model, batch):
    whole_lp, whole_ent, _, width = _pass(model, batch, 0, entropy_grad=False)
    assert whole_lp.dtype == torch.float32 and CHUNKS[-1] > len(batch) * width
    for chunk in CHUNKS:
        lp, ent, _, _ = _pass(model, batch, chunk, entropy_grad=False)
        assert torch.allclose(lp, whole_lp, rtol=0, atol=1e-6), f"chunk {chunk}: logprobs"
        assert torch.allclose(ent, whole_ent, rtol=0, atol=1e-6), f"chunk {chunk}: entropy"


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_gradients_equal_the_unchunked_ones(model, batch, entropy_grad):
    # a float64 model: the logprob math is float32 either way, but the gradients then sum over tokens in float64,
    # where another order of summation is invisible (in float32 it would hide a real error in the vision tower's
    # many small gradients)
    model.to(torch.float64)
    try:
        _, _, whole, _ = _pass(model, batch, 0, entropy_grad)
        assert any("visual" in name for name in whole) and "lm_head.weight" in whole
        for chunk in CHUNKS:
            _, _, grads, _ = _pass(model, batch, chunk, entropy_grad)
            assert grads.keys() == whole.keys(), f"chunk {chunk}"
            for name, grad in grads.items():
                assert torch.allclose(grad, whole[name], rtol=1e-9, atol=1e-12), f"chunk {chunk}: {name}"
    finally:
        model.to(torch.float32)


def test_the_entropy_has_a_graph_only_when_asked(model, batch):
    mb = micro_batch(batch, range(4), torch.device("cpu"))
    for chunk in (0, 5):
        logprobs, metric = forward_response(model, mb, 1.0, True, entropy_grad=False, chunk=chunk)
        assert logprobs.requires_grad and not metric.requires_grad
        _, bonus = forward_response(model, mb, 1.0, True, entropy_grad=True, chunk=chunk)
        assert bonus.requires_grad


def test_a_failing_forward_gives_the_model_its_lm_head_back(model, batch):
    head = model.get_output_embeddings()
    mb = micro_batch(batch, range(2), torch.device("cpu"))
    mb.position_ids = mb.position_ids[:, :, :-1]  # one column short: the forward raises
    with pytest.raises(Exception):  # noqa: B017 - whatever transformers raises, the head must be restored
        forward_response(model, mb, 1.0, False, chunk=4)
    assert model.get_output_embeddings() is head
