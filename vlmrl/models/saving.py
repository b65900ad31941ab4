"""A model folder in the layout its readers load: transformers, vLLM and SGLang.

`save_model` is the one way vlmrl writes model weights (the trainer's checkpoints, full or LoRA-merged, at any dp;
the embedded tiny models). transformers' `save_pretrained` writes most of a folder right, but not every family's
routed experts: transformers 5.19 saves Qwen3-VL-MoE's fused experts in its in-memory orientation ((E, 2I, H) /
(E, H, I)), which neither engine loads (vLLM: "The size of tensor a (40) must match the size of tensor b (128)"),
while the hub's checkpoints, and both engines' loaders, hold them transposed. So the saved experts are rewritten into
the family's checkpoint layout by `vlmrl.models.experts.convert`, the conversion the weight sync sends the engines
too, and the folder's expert names are then checked against what that layout must hold.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlmrl.models.experts import FUSED_NAME, PER_EXPERT_NAME, ExpertShape, convert, convert_names
from vlmrl.models.families import family_of

INDEX = "model.safetensors.index.json"


def save_model(model: Any, folder: str | Path) -> None:
    """`model.save_pretrained(folder)` (safetensors + config + generation config), its routed experts (a MoE family)
    then in the family's checkpoint layout. Raises ValueError when the folder does not hold the experts the model
    has in that layout (a transformers version that saves otherwise than this module expects)."""
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    family = family_of(model.config)
    if family.experts is None:
        return
    shape = ExpertShape.of(model.config)
    layout = family.experts.checkpoint_layout
    to_checkpoint_layout(folder, layout, shape)
    memory = [family.weights.checkpoint_name(name) for name in model.state_dict() if FUSED_NAME.match(name)]
    check_expert_names(folder, set(convert_names(memory, layout, shape)), layout, shape)


def to_checkpoint_layout(folder: str | Path, layout: str, shape: ExpertShape) -> None:
    """Rewrite the fused expert tensors of the safetensors files `save_pretrained` wrote into `layout` (files already
    in it are left alone), one file at a time, atomically; a sharded folder's index follows renamed tensors."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vlmrl.atomic import replace_atomically, write_text_atomically

    folder = Path(folder)
    shape.check_orientable()
    renamed: dict[str, str] = {}  # new tensor name -> its file (per-expert names replace fused ones)
    dropped: set[str] = set()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            if not any(FUSED_NAME.match(name) for name in f.keys()):  # from the header: no tensor read
                continue
            metadata = f.metadata()
            state = {name: f.get_tensor(name) for name in f.keys()}
        converted = dict(convert(state.items(), layout, shape))
        replace_atomically(file, lambda tmp, converted=converted: save_file(converted, str(tmp), metadata=metadata))
        dropped.update(set(state) - set(converted))
        renamed.update({name: file.name for name in set(converted) - set(state)})
    index = folder / INDEX
    if (renamed or dropped) and index.exists():
        data = json.loads(index.read_text())
        weight_map = {k: v for k, v in data["weight_map"].items() if k not in dropped}
        data["weight_map"] = dict(sorted({**weight_map, **renamed}.items()))
        write_text_atomically(index, json.dumps(data, indent=2) + "\n")


def check_expert_names(folder: str | Path, expected: set[str], layout: str, shape: ExpertShape) -> None:
    """The expert tensors of the folder's safetensors files are exactly `expected` (their names in `layout`), fused
    ones (fused-transposed) in the hub's orientation."""
    from safetensors import safe_open

    saved: set[str] = set()
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                m = FUSED_NAME.match(name)
                if m is not None and layout == "fused-transposed":
                    hub = tuple(shape.fused(m["kind"])[i] for i in (0, 2, 1))
                    if tuple(f.get_slice(name).get_shape()) != hub:
                        raise ValueError(f"{file}: {name} has shape {tuple(f.get_slice(name).get_shape())}, not "
                                         f"the checkpoints' {hub} (experts, in, out)")
                if m is not None or PER_EXPERT_NAME.match(name):
                    saved.add(name)
    if saved != expected:
        missing, extra = sorted(expected - saved), sorted(saved - expected)
        raise ValueError(f"{folder}: the saved experts are not in the {layout} layout the engines load: missing "
                         f"{missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected "
                         f"{extra[:3]}{'...' if len(extra) > 3 else ''}")
