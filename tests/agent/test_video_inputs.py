"""A conversation whose prompt holds a video keeps the video's inputs when tools add images."""

from __future__ import annotations

import torch

from vlmrl.agent.trajectory import _concat_mm


def test_tool_images_join_a_video_prompt_without_dropping_the_video():
    video = {"pixel_values_videos": torch.ones(8, 4), "video_grid_thw": torch.tensor([[1, 2, 4]]),
             "second_per_grid_ts": torch.tensor([1.0])}
    tool = {"pixel_values": torch.zeros(4, 4), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    joined = _concat_mm(video, tool)
    assert sorted(joined) == sorted([*video, *tool])
    both = _concat_mm({**video, **tool}, tool)
    assert both["pixel_values"].shape == (8, 4) and both["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2]]
    assert torch.equal(both["pixel_values_videos"], video["pixel_values_videos"])
