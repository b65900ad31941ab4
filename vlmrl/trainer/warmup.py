"""The format warm-up: supervised steps on RANDOM answer labels, before RL, that teach the answer format only.

Why: a random-init model (the embedded `tiny`) never emits a gradable answer, so every GRPO group has equal rewards
(all 0) and nothing is learned (measured: reward 0 for 327 steps). The warm-up shows it what an answer looks like —
one word from the task's closed answer set, then the end-of-turn token — with the label drawn uniformly at random,
independently of the image. Labels that carry no information about the image cannot teach which answer is right:
after the warm-up, accuracy stays at chance (1 / number of answers); only the RL that follows can raise it.

It uses its own AdamW (discarded afterwards) so the RL optimizer and its schedule start fresh.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from vlmrl.actor.local import Actor
from vlmrl.batch.padding import pad_sample, stack_samples
from vlmrl.config import Config
from vlmrl.data.dataset import RLDataset
from vlmrl.processors.base import Processor
from vlmrl.processors.errors import FilteredRow

logger = logging.getLogger(__name__)

MAX_ANSWERS = 64
"""A warm-up needs a closed answer set; more distinct answers than this means an open-ended task (e.g. geo3k)."""


def answer_set(dataset: RLDataset) -> list[str]:
    """The distinct ground truths of a dataset, sorted; ValueError when the task is open-ended."""
    answers = sorted({str((rm or {}).get("ground_truth")) for rm in dataset.column("reward_model")})
    if len(answers) > MAX_ANSWERS:
        raise ValueError(f"trainer.format_warmup_steps needs a task with a closed answer set; {dataset.spec} has "
                         f"{len(answers)} distinct answers (> {MAX_ANSWERS}): set trainer.format_warmup_steps=0")
    return answers


def format_warmup(actor: Actor, processor: Processor, dataset: RLDataset, config: Config) -> list[float]:
    """Run `trainer.format_warmup_steps` supervised steps on random labels; returns the loss of each step.

    Each step: `format_warmup_batch_size` random training prompts, each paired with an answer drawn uniformly from
    the answer set (NOT its ground truth), trained to emit `<answer><eos>`.
    """
    t = config.trainer
    answers = answer_set(dataset)
    label_ids = {a: processor.tokenizer.encode(a, add_special_tokens=False) + [processor.eos_token_ids[0]]
                 for a in answers}
    rng = np.random.default_rng([t.seed, 0x5EED])
    # one device (checked at config load): the single-process Actor's trainable parameters (with LoRA: the adapters)
    trainable = list(actor.trainable)
    optimizer = torch.optim.AdamW(trainable, lr=t.format_warmup_lr, weight_decay=0.0)
    response_length = max(len(ids) for ids in label_ids.values())
    losses = []
    logger.info("format warm-up: %d steps x %d prompts on random labels from %s (lr %g)", t.format_warmup_steps,
                t.format_warmup_batch_size, answers, t.format_warmup_lr)
    for _ in range(t.format_warmup_steps):
        samples = []
        for index in rng.choice(len(dataset), size=t.format_warmup_batch_size, replace=False):
            try:
                request = processor.build_request(dataset[int(index)], int(index))
            except FilteredRow:
                continue
            label = answers[int(rng.integers(len(answers)))]  # independent of the row: format, not answers
            samples.append(pad_sample(processor.prompt_inputs(request), label_ids[label],
                                      prompt_length=config.data.max_prompt_length, response_length=response_length,
                                      pad_token_id=processor.pad_token_id))
        if not samples:
            raise ValueError("format warm-up: every sampled prompt was filtered; raise data.max_prompt_length")
        losses.append(actor.supervised_step(stack_samples(samples), optimizer))
    if losses:
        logger.info("format warm-up done: loss %.3f -> %.3f (chance level ln %d = %.3f for the answer token)",
                    losses[0], losses[-1], len(answers), float(np.log(len(answers))))
    return losses
