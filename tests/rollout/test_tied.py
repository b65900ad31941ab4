"""Tied input/output embeddings (the layout of Qwen2.5-VL-3B): the trainer's state_dict() lists lm_head.weight, the
checkpoint the engine started from does not. Every backend's weight sync takes the trainer's full state dict, lands the
shared tensor in both roles (outputs equal the reference given the same weights), and refuses a copy that no longer
matches the tensor it is tied to, before the engine sees it. One engine per test, started on the tied model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.rollout.helpers import GREEDY, greedy_mismatch
from vlmrl.rollout.weights import checkpoint_names

EMBED, LM_HEAD = "model.language_model.embed_tokens.weight", "lm_head.weight"


@pytest.fixture(scope="module")
def tied_model(tiny_model_path, tmp_path_factory) -> str:
    """The tiny model with its output layer tied to the input embedding, saved as transformers saves tied models."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    folder = tmp_path_factory.mktemp("tied")
    config = AutoConfig.from_pretrained(tiny_model_path)
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = True
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_path, config=config)
    model.tie_weights()  # the tiny checkpoint holds two different tensors, which from_pretrained leaves untied
    model.save_pretrained(folder)
    for file in sorted(p for p in Path(tiny_model_path).iterdir() if p.is_file()):
        if not (folder / file.name).exists():
            shutil.copy2(file, folder / file.name)  # tokenizer and processor files
    assert "lm_head.weight" not in checkpoint_names(str(folder)), "not saved as a tied checkpoint"
    return str(folder)


@pytest.fixture(scope="module")
def trainer_state(tied_model) -> dict[str, torch.Tensor]:
    """What the actor sends: transformers' state_dict() of the tied model (lm_head.weight included, same tensor)."""
    from transformers import AutoModelForImageTextToText

    state = AutoModelForImageTextToText.from_pretrained(tied_model).state_dict()
    assert state[LM_HEAD].data_ptr() == state[EMBED].data_ptr(), "the model did not tie its embeddings"
    return {name: t.detach().clone() for name, t in state.items()}


@pytest.fixture(scope="module")
def tied_reference(tied_model):
    from vlmrl.rollout.registry import get_backend

    with get_backend("hf", tied_model, dtype="float32", max_model_len=1024, timeout_s=300) as backend:
        yield backend


def shifted_embeddings(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state with the shared embedding shifted (seeded), sent under both names as the trainer would."""
    gen = torch.Generator().manual_seed(3)
    embed = state[EMBED] + 0.5 * torch.randn(state[EMBED].shape, generator=gen)
    return {**state, EMBED: embed, LM_HEAD: embed}


@pytest.mark.parametrize("name", ["hf", pytest.param("vllm", marks=pytest.mark.vllm),
                                  pytest.param("sglang", marks=pytest.mark.sglang)])
def test_a_tied_model_takes_the_trainers_full_state_dict(name, tied_model, trainer_state, tied_reference, batch):
    from vlmrl.rollout.registry import get_backend

    shifted = shifted_embeddings(trainer_state)
    with get_backend(name, tied_model, dtype="float32", max_model_len=1024, timeout_s=300) as backend:
        first = backend.generate(batch, GREEDY)
        backend.update_weights(shifted.items())
        after = backend.generate(batch, GREEDY)
        tied_reference.update_weights(shifted.items())
        try:
            expected = tied_reference.generate(batch, GREEDY)
        finally:
            tied_reference.update_weights(trainer_state.items())
        problems = [m for ref, got in zip(expected, after) if (m := greedy_mismatch(ref, got, name))]
        assert not problems, "synced tied weights != the reference given them:\n" + "\n".join(problems)
        assert sum(a.response_ids != b.response_ids for a, b in zip(first, after)) >= len(batch) // 2

        untied = {**trainer_state, LM_HEAD: trainer_state[LM_HEAD] + 1.0}
        with pytest.raises(ValueError, match="ties lm_head.weight to model.embed_tokens.weight"):
            backend.update_weights(untied.items())

        backend.update_weights(trainer_state.items())
        restored = backend.generate(batch, GREEDY)
        assert [r.response_ids for r in restored] == [r.response_ids for r in first]
