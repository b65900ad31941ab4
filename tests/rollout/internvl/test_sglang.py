"""SGLang (in-process, fp32) on the embedded InternVL3.5 against transformers. sglang 0.5.23 serves transformers'
InternVL format only through its Transformers fallback, from chat text: vlmrl sends the request's prompt ids
decoded to text (checked to tokenize back to them) with the images, checks at start that the engine expands a
probe's text into exactly the ids the trainer scores, and checks every prompt's expanded length. The engine
contract on it is a line of tests/rollout/test_family_contract.py."""

from __future__ import annotations

import pytest


pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def backend(sglang_internvl):
    return sglang_internvl


def test_prompt_ids_that_are_not_their_texts_tokens_are_refused_before_the_engine(backend, batch):
    """The text form is the same request only when the ids are the text's own tokenization: ids spelling a word in
    other pieces would reach the engine as other ids, so they are refused, naming the request."""
    import dataclasses

    from tests.rollout.helpers import GREEDY
    from vlmrl.rollout.errors import InvalidRequestError

    tokenizer = backend.processor.tokenizer
    word = tokenizer.encode(" picture", add_special_tokens=False)
    pieces = [i for ch in " picture" for i in tokenizer.encode(ch, add_special_tokens=False)]
    assert pieces != word  # the same text in other tokens
    request = dataclasses.replace(batch[3], uid="split-word", prompt_ids=list(batch[3].prompt_ids[:-3]) + pieces
                                  + list(batch[3].prompt_ids[-3:]))
    with pytest.raises(InvalidRequestError, match="split-word.*do not tokenize back"):
        backend.generate([request], GREEDY)


def test_the_start_up_check_catches_an_expansion_the_trainer_does_not_share(backend):
    """The probe the backend ran at start, run again with the trainer's side counting 15 tokens a tile instead of the
    model's 16 (what a processor out of step with the engine would score): the engine's ids differ, and the check
    says where."""
    from vlmrl.rollout.errors import RolloutError

    processor = backend.processor
    own = processor.tokens_per_tile
    processor.tokens_per_tile = own - 1
    try:
        with pytest.raises(RolloutError, match="expands InternVL3.5's text prompt into .* first difference"):
            backend.check_text_prompts(lambda body: backend.call_engine("generate", body))
    finally:
        processor.tokens_per_tile = own
