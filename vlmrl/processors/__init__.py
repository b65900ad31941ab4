"""Processors: dataset rows -> one `RolloutRequest` for every backend; the trainer's image and video inputs and mrope
ids.

- `qwen_vl`: `Processor` and `load_processor` (chat -> request, the trainer's `multi_modal_inputs`);
- `images`, `video`: load, verify and resize images and videos once, as the model's own processor sizes them;
  `bounds`: the run's pixel bounds against the model's processor; `rope`: the one owner of mrope position ids;
- `errors`: `BadRowError` and `FilteredRow`, a row's problem named with its row and file.
"""
