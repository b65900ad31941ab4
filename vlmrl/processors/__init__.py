"""Processors: dataset rows -> one `RolloutRequest` for every backend; the trainer's image and video inputs and mrope
ids.

- `base`: `Processor`, what every family shares (chat -> request, the trainer's inputs of a request); `patches`
  (Qwen-VL-style families, GLM-4.1V) and `tiles` (InternVL): its image layouts; `loading`: `load_processor`, the
  family's processor of a model folder;
- `images`, `video`: load, verify and resize images and videos once, as the model's own processor sizes them;
  `bounds`: the run's pixel bounds against the model's processor; `rope`: the one owner of mrope position ids;
- `errors`: `BadRowError` and `FilteredRow`, a row's problem named with its row and file.
"""
