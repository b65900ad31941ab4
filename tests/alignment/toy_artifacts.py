"""Synthetic validation artifacts from a toy deterministic 'model', with the faults the alignment tool must find.

The toy model: at each step the logits (VOCAB,) are a seeded function of (row, image size, prefix), decoding is
greedy, logprobs are log-softmax of the logits. Faults are knobs on one side:
  - max_pixels: images resized differently -> different image hashes, sizes, grids, expanded lengths (and outputs);
  - logit_noise: perturbed 'weights' -> logits move a lot -> real divergences;
  - flip_rows: at token 2 of these rows the top two logits are 1e-4 apart and swap -> a numerical near-tie;
  - reward: a different reward function scoring the same text;
  - max_new_tokens: a shorter budget -> length/finish-reason only.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

from vlmrl.alignment.artifact import (
    ArtifactMeta,
    DatasetIdentity,
    ValidationRecord,
    thumbnail_png_base64,
    write_artifact,
)

VOCAB = 40
EOS = 0
LETTERS = "$abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLM"  # token t -> LETTERS[t]; '$' is EOS
PROMPT = [901, 902, 903, 950, 904]  # 950 = the one unexpanded image pad
TOP_K = 5


def _rng(*key: object) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def resized(row: int, max_pixels: int) -> tuple[int, int]:
    """qwen-vl-utils-like resize of row's (w, h) image to multiples of 28 within max_pixels."""
    w, h = 140 + 28 * (row % 5), 112 + 28 * (row % 3)
    scale = min(1.0, math.sqrt(max_pixels / (w * h)))
    return max(28, int(w * scale) // 28 * 28), max(28, int(h * scale) // 28 * 28)


def reward_contains(text: str, truth: str) -> float:
    return 1.0 if truth in text else 0.0


def reward_first_letter(text: str, truth: str) -> float:
    return 1.0 if text[:1] == truth else 0.0


def decode(row: int, size: tuple[int, int], *, logit_noise: float = 0.0, flip: bool = False,
           max_new_tokens: int = 12, top_k: int | None = TOP_K):
    """Greedy decoding of the toy model: (ids, logprobs, top, finish_reason)."""
    ids: list[int] = []
    logprobs: list[float] = []
    top: list[list[list[float]]] = []
    for t in range(max_new_tokens):
        logits = _rng(row, size, tuple(ids)).normal(0.0, 2.0, VOCAB)
        logits[EOS] += -4.0 if t < 6 else 3.0
        if logit_noise:
            logits = logits + _rng("noise", row, t).normal(0.0, logit_noise, VOCAB)
        if t == 2:
            order = np.argsort(-logits)
            logits[order[1]] = logits[order[0]] + (1e-4 if flip else -1e-4)  # near-tie: swap the top two
        lp = logits - np.logaddexp.reduce(logits)
        token = int(np.argmax(lp))
        ids.append(token)
        logprobs.append(float(lp[token]))
        best = np.argsort(-lp)[: top_k or 0]
        top.append([[int(i), float(lp[i])] for i in best])
        if token == EOS:
            return ids, logprobs, (top if top_k else None), "stop"
    return ids, logprobs, (top if top_k else None), "length"


def make_side(rows: int = 30, *, backend: str = "vllm", max_pixels: int = 12544, logit_noise: float = 0.0,
              flip_rows: frozenset[int] = frozenset(), reward=reward_contains, max_new_tokens: int = 12,
              top_k: int | None = TOP_K, dataset: str = "synthetic:val", temperature: float = 0.0,
              sources: tuple[str, ...] = ("colours", "shapes")):
    """(meta, records) of one side's validation on `rows` toy rows."""
    records = []
    for row in range(rows):
        size = resized(row, max_pixels)
        ids, logprobs, top, finish = decode(row, size, logit_noise=logit_noise, flip=row in flip_rows,
                                            max_new_tokens=max_new_tokens, top_k=top_k)
        text = "".join(LETTERS[t] for t in ids)
        truth = LETTERS[1 + row % 12]
        records.append(ValidationRecord(
            uid=f"row-{row}", index=row, sample_index=0, data_source=sources[row % len(sources)],
            prompt_ids=list(PROMPT), expanded_prompt_length=len(PROMPT) - 1 + (size[0] // 28) * (size[1] // 28),
            image_hashes=[hashlib.sha256(f"{row}-{size}".encode()).hexdigest()], image_sizes=[list(size)],
            image_grid_thw=[[1, size[1] // 14, size[0] // 14]],
            response_ids=ids, response_text=text, response_logprobs=logprobs, finish_reason=finish,
            reward=reward(text, truth), reward_extra={"accuracy": reward(text, truth)}, ground_truth=truth,
            top_logprobs=top,
            thumbnails=[thumbnail_png_base64(Image.new("RGB", size, ((row * 40) % 255, 90, 160)))],
        ))
    meta = ArtifactMeta(
        backend=backend, engine=backend, engine_version="1.0", model_path="toy",
        dataset=DatasetIdentity(paths=[dataset], rows=rows, fingerprint=hashlib.sha256(dataset.encode()).hexdigest()),
        sampling={"n": 1, "temperature": temperature, "max_new_tokens": max_new_tokens, "top_logprobs": top_k or 0},
        config={"data": {"max_pixels": max_pixels}, "rollout": {"name": backend}},
    )
    return meta, records


def write_side(path: Path, **kwargs) -> Path:
    meta, records = make_side(**kwargs)
    return write_artifact(path, meta, records)
