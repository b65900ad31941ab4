"""Data configuration: datasets, batch sizes and lengths (the run config's `data` section).

The image and prompt-length keys (data.min_pixels, data.max_prompt_length, data.on_bad_image, ...) are the
processor's: `DataConfig` inherits `vlmrl.processors.config.ProcessorConfig`, so the run's data section is the
processor's config.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlmrl.processors.config import ProcessorConfig


@dataclass
class DataConfig(ProcessorConfig):
    train_files: str = ""
    """Training data: parquet file(s) in the verl/EasyR1 schema (comma-separated, globs allowed), or `synthetic` for
    the embedded visual task."""
    val_files: str = ""
    """Validation data, same forms as train_files (`synthetic`: the task's held-out split). Empty: no validation."""
    prompt_key: str = "prompt"
    """Column holding the chat messages."""
    image_key: str = "images"
    """Column holding the images ({bytes} / {path} / PIL)."""
    train_batch_size: int = 512
    """Prompts per training step (each is sampled rollout.n times)."""
    val_batch_size: int = -1
    """Prompts per validation generate call; -1 = the whole validation set in one call."""
    max_response_length: int = 2048
    """Most tokens generated per sample."""
    shuffle: bool = True
    """Shuffle training rows every epoch (seeded by trainer.seed)."""
    synthetic_train_size: int = 2048
    """Rows in the synthetic task's train split (only for `synthetic`)."""
    synthetic_val_size: int = 128
    """Rows in the synthetic task's held-out split (only for `synthetic`)."""

    def problems(self) -> list[str]:
        """What is wrong, each with what to change; empty when valid."""
        out = []
        for name in ("train_batch_size", "max_response_length"):
            if getattr(self, name) < 1:
                out.append(f"data.{name}={getattr(self, name)} must be >= 1")
        return out + super().problems()
