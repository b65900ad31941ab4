"""Errors for dataset rows that cannot become a request: the caller sees which row and why, and can count skips."""

from __future__ import annotations


class BadRowError(ValueError):
    """A dataset row that cannot become a rollout request (bad image, placeholder mismatch, overlong prompt...)."""

    def __init__(self, row_index: int, reason: str):
        self.row_index = row_index
        self.reason = reason
        where = f"row {row_index}" if row_index >= 0 else "row (no index)"
        super().__init__(f"{where}: {reason}")


class FilteredRow(BadRowError):
    """A row skipped on purpose because the config says to filter such rows (`filter_overlong_prompts`,
    `on_bad_image="filter"`). The data loader catches it, counts it and logs the reason; it is not a failure."""
