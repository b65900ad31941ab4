"""The embedded models: tiny random-init Qwen2.5-VL, Qwen3-VL and Qwen3.5 built locally, without any hub access.

`build(out_dir)` writes tokenizer, chat template, image processor, config, generation config and safetensors
weights. Rebuilding gives byte-identical files on any machine with the same torch/transformers: the tokenizer files
are committed (`tiny_assets/`, made by `scripts/make_tiny_tokenizer.py`) and every parameter is drawn from one
seeded generator. The result loads through `AutoProcessor` and `AutoModelForImageTextToText`, and both vLLM and
SGLang serve it.

Variants (pass the name wherever a model path is taken):
  - ``tiny``:  text hidden 128, 2 layers; vision depth 2, hidden 64 (~0.85 M params, ~3.5 MB). Tests and the demo.
  - ``tiny-large``: text hidden 768, 6 layers; vision depth 4, hidden 256 (~50 M params, ~200 MB). Benchmarks.
  - ``tiny-qwen3-vl``: a Qwen3-VL: text hidden 128, 3 layers, head_dim 64, interleaved mrope [12, 10, 10]; vision
    depth 3, patch 16, deepstack mergers at vision layers 0 and 1 (~1.3 M params). Same tokenizer and template.
  - ``tiny-qwen3.5``: a Qwen3.5: text hidden 128, 3 layers [Gated DeltaNet, Gated DeltaNet, full attention]
    (full_attention_interval 3), head_dim 64 with partial rotary 0.25 (interleaved mrope [3, 3, 2] over 16 dims),
    linear attention 1 key / 2 value heads of 128 (the only size vLLM's CPU kernel takes, as in the released
    models); vision depth 2, patch 16, no deepstack (~1.2 M params). Same tokenizer and template.
  - ``tiny-qwen3-vl-moe``: a Qwen3-VL-MoE (Qwen3-VL-30B-A3B's architecture) on tiny-qwen3-vl's shapes (three
    deepstack mergers, at vision layers 0-2, as the released model has three), every decoder layer a mixture of 4
    experts, top-2, expert intermediate 48 (2 x 48 != hidden 128, so an expert tensor loaded in the wrong
    orientation fails instead of loading silently); saved in the hub's layout (`vlmrl.models.experts`).
  - ``tiny-qwen3.5-moe``: a Qwen3.5-MoE (Qwen3.5-35B-A3B's) on tiny-qwen3.5's shapes, the same experts plus a gated
    shared expert (intermediate 64); saved per expert, as transformers and the released checkpoints do.
  - ``tiny-glm4v`` and ``tiny-internvl``: GLM-4.1V and InternVL3.5 with their own tokens and templates (the latter
    in `vlmrl.models.tiny_internvl`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vlmrl.models import tiny_internvl as internvl
from vlmrl.models.tiny_internvl import TinyInternVLSpec
from vlmrl.utils.paths import cache_root

if TYPE_CHECKING:  # torch is imported where a model is built: the launcher resolves names without it
    import torch

logger = logging.getLogger(__name__)

ASSETS = Path(__file__).parent / "tiny_assets"
BUILDER_VERSION = 1  # bump when the produced files change
SEED = 0
VOCAB_SIZE = 1024  # model vocab (>= tokenizer size), a multiple of 64

SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>",
]

# The Qwen2-VL chat template (images/videos as content parts), with Qwen2.5's tool-call support for the agent loop.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    text_hidden: int
    text_layers: int
    text_heads: int
    text_intermediate: int
    mrope_section: tuple[int, int, int]
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    min_pixels: int
    max_pixels: int


@dataclass(frozen=True)
class TinyQwen3Spec:
    text_hidden: int
    text_layers: int
    text_heads: int
    head_dim: int
    text_intermediate: int
    mrope_section: tuple[int, int, int]
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    deepstack_layers: tuple[int, ...]
    """Vision layers whose features a deepstack merger adds to the first decoder layers."""
    num_position_embeddings: int
    """Learned vision position embeddings (a square grid, interpolated to each image's patch grid)."""
    min_pixels: int
    max_pixels: int


@dataclass(frozen=True)
class TinyQwen3_5Spec:
    text_hidden: int
    layer_types: tuple[str, ...]
    """Each decoder layer's token mixer: linear_attention (Gated DeltaNet) or full_attention."""
    text_heads: int
    head_dim: int
    text_intermediate: int
    partial_rotary_factor: float
    """Share of head_dim that rotary embeddings turn (0.25 in the released models)."""
    mrope_section: tuple[int, int, int]
    """Sums to head_dim * partial_rotary_factor / 2."""
    linear_key_heads: int
    linear_value_heads: int
    linear_head_dim: int
    """Key and value head size of the linear-attention layers."""
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    num_position_embeddings: int
    min_pixels: int
    max_pixels: int


@dataclass(frozen=True)
class TinyGlm4vSpec:
    text_hidden: int
    text_layers: int
    text_heads: int
    head_dim: int
    text_intermediate: int
    partial_rotary_factor: float
    mrope_section: tuple[int, int, int]
    vision_depth: int
    vision_hidden: int
    vision_heads: int
    vision_intermediate: int
    vision_image_size: int
    """Side of the square its learned position embeddings cover (image_size / patch 14 patches a side), interpolated
    to each image's grid."""
    min_pixels: int
    max_pixels: int
    """Per image (h x w); GLM-4.1V's image processor counts an image's two temporal copies, so its config says 2x."""


@dataclass(frozen=True)
class TinyMoESpec:
    base: TinyQwen3Spec | TinyQwen3_5Spec
    """The dense variant's shapes; the decoder's MLPs become mixtures of experts."""
    experts: int
    top_k: int
    expert_intermediate: int
    """Keep 2 x expert_intermediate != text_hidden: a transposed expert tensor then cannot load."""
    shared_expert_intermediate: int = 0
    """Qwen3.5-MoE's gated shared expert (0: none, Qwen3-VL-MoE)."""


VARIANTS: dict[str, TinySpec | TinyQwen3Spec | TinyQwen3_5Spec | TinyMoESpec | TinyGlm4vSpec | TinyInternVLSpec] = {
    "tiny": TinySpec(128, 2, 2, 256, (8, 12, 12), 2, 64, 2, 128, 28 * 28 * 4, 28 * 28 * 16),
    "tiny-large": TinySpec(768, 6, 6, 2048, (16, 24, 24), 4, 256, 4, 512, 28 * 28 * 4, 28 * 28 * 64),
    # Qwen3-VL's factor is 32 (patch 16 x merge 2): 4..16 merged tokens per image, as for `tiny`
    "tiny-qwen3-vl": TinyQwen3Spec(128, 3, 2, 64, 256, (12, 10, 10), 3, 64, 2, 128, (0, 1), 64,
                                   32 * 32 * 4, 32 * 32 * 16),
    "tiny-qwen3.5": TinyQwen3_5Spec(128, ("linear_attention", "linear_attention", "full_attention"), 2, 64, 256,
                                    0.25, (3, 3, 2), 1, 2, 128, 2, 64, 2, 128, 64, 32 * 32 * 4, 32 * 32 * 16),
}
# three deepstack mergers, as the released Qwen3-VL-MoE: SGLang's Qwen3-VL-MoE adds exactly three
VARIANTS["tiny-qwen3-vl-moe"] = TinyMoESpec(dataclasses.replace(VARIANTS["tiny-qwen3-vl"], deepstack_layers=(0, 1, 2)),
                                            4, 2, 48)
VARIANTS["tiny-qwen3.5-moe"] = TinyMoESpec(VARIANTS["tiny-qwen3.5"], 4, 2, 48, shared_expert_intermediate=64)
# GLM-4.1V: partial rotary 0.5 (32 of head_dim 64), mrope sections over it [4, 6, 6]; patch 14 x merge 2 as `tiny`
VARIANTS["tiny-glm4v"] = TinyGlm4vSpec(128, 2, 2, 64, 256, 0.5, (4, 6, 6), 2, 64, 2, 128, 56,
                                       28 * 28 * 4, 28 * 28 * 16)
# InternVL3.5: 64-pixel tiles of 8-pixel patches, pixel shuffle 0.5 (16 tokens a tile), up to 4 tiles + a thumbnail
VARIANTS["tiny-internvl"] = TinyInternVLSpec(128, 2, 2, 64, 256, 64, 2, 2, 128, 64, 8, 0.5, 4)

GLM_SPECIAL_TOKENS = [
    "<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>", "<|video|>",
    "<think>", "</think>", "<|begin_of_box|>", "<|end_of_box|>",
]
# GLM-4.1V's chat template reduced to what a prompt needs: images and videos as content parts, tool replies as
# <|observation|> turns (the agent loop's `template` tool-turn format)
GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>{%- for msg in messages %}"
    "{%- if msg.role == 'system' %}<|system|>\n{{ msg.content }}"
    "{%- elif msg.role == 'user' %}<|user|>\n"
    "{% if msg.content is string %}{{ msg.content }}{%- else %}{%- for item in msg.content %}"
    "{%- if item.type == 'video' or 'video' in item %}<|begin_of_video|><|video|><|end_of_video|>"
    "{%- elif item.type == 'image' or 'image' in item or 'image_url' in item %}"
    "<|begin_of_image|><|image|><|end_of_image|>"
    "{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- elif msg.role == 'assistant' %}<|assistant|>\n{{ msg.content }}"
    "{%- elif msg.role == 'tool' or msg.role == 'observation' %}<|observation|>\n"
    "{% if msg.content is string %}{{ msg.content }}{%- else %}{%- for item in msg.content %}"
    "{%- if item.type == 'image' or 'image' in item %}<|begin_of_image|><|image|><|end_of_image|>"
    "{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}{%- endfor %}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _fingerprint(variant: str) -> str:
    import torch
    import transformers

    h = hashlib.sha256()
    h.update(json.dumps([BUILDER_VERSION, asdict(VARIANTS[variant]), torch.__version__.split("+")[0],
                         transformers.__version__]).encode())
    for name in ("vocab.json", "merges.txt"):
        h.update((ASSETS / name).read_bytes())
    if isinstance(VARIANTS[variant], TinyGlm4vSpec):
        h.update(json.dumps([GLM_SPECIAL_TOKENS, GLM_CHAT_TEMPLATE]).encode())
    if isinstance(VARIANTS[variant], TinyInternVLSpec):
        h.update(json.dumps(internvl.BUILD_FACTS).encode())
    return h.hexdigest()[:12]


def is_embedded(name: str) -> bool:
    return name in VARIANTS


HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]
"""What a hub snapshot fetches: configs, safetensors weights, tokenizer and processor files (no pickled *.bin)."""

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """A local model folder for `name_or_path`: an embedded name (`tiny`, `tiny-qwen3-vl`, `tiny-qwen3.5`...) built
    once; a local folder as it is; a hub id
    (`Qwen/Qwen2.5-VL-7B-Instruct`) downloaded once into the Hugging Face cache (safetensors only; with
    HF_HUB_OFFLINE=1 the cached copy). Anything else raises FileNotFoundError naming it."""
    name = str(name_or_path)
    if name in VARIANTS:
        return str(ensure_built(name))
    local = Path(name).expanduser()
    if local.is_dir():
        return str(local)
    if is_hub_id(name):
        return _hub_snapshot(name)
    raise FileNotFoundError(f"model {name!r}: no such folder (nor an embedded name {sorted(VARIANTS)} or a hub id "
                            "like Qwen/Qwen2.5-VL-7B-Instruct)")


def is_hub_id(name: str) -> bool:
    """`org/name` as the Hugging Face hub spells a repository (not a path: no leading /, . or ~, one slash)."""
    return _HUB_ID.fullmatch(name) is not None


@functools.lru_cache(maxsize=None)
def _hub_snapshot(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=HUB_FILES)
    except Exception as err:  # noqa: BLE001 - offline, unknown repo, gated, network: all say the same to the user
        raise FileNotFoundError(f"model {repo_id!r} is not a local folder and could not be fetched from the "
                                f"Hugging Face hub ({type(err).__name__}: {err}); download it first "
                                f"(`huggingface-cli download {repo_id}`) or give a local folder") from err


def ensure_built(variant: str = "tiny") -> Path:
    """Build the variant into the cache unless an identical build is there. Safe under concurrent callers:
    each builds into a temporary folder and renames it into place; a loser of the race keeps the winner's copy."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown embedded model {variant!r}; choose one of {sorted(VARIANTS)}")
    target = cache_root() / "models" / f"{variant}-{_fingerprint(variant)}"
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{variant}-", dir=target.parent))
    try:
        logger.info("building embedded model %r into %s", variant, target)
        build(tmp, variant)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_tokenizer(special: list[str] = SPECIAL_TOKENS, template: str = CHAT_TEMPLATE, eos: str = "<|im_end|>",
                     **extra):
    """The embedded byte-level BPE with a family's special tokens and chat template (Qwen's by default)."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab = json.loads((ASSETS / "vocab.json").read_text())
    merges = [tuple(line.split(" ")) for line in (ASSETS / "merges.txt").read_text().splitlines()[1:] if line]
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None, eos_token=eos,
                         pad_token="<|endoftext|>", errors="replace", model_max_length=4096, **extra)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in special], special_tokens=True)
    tok.chat_template = template
    assert len(tok) <= VOCAB_SIZE, len(tok)
    return tok


def build(out_dir: str | os.PathLike, variant: str = "tiny") -> Path:
    """Write the full model folder for `variant` into out_dir (created if needed)."""
    spec = VARIANTS[variant]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(spec, TinyGlm4vSpec):
        _build_glm4v(out, spec)
        return out
    if isinstance(spec, TinyInternVLSpec):
        tok = _build_tokenizer(SPECIAL_TOKENS + internvl.INTERNVL_SPECIAL_TOKENS, internvl.INTERNVL_CHAT_TEMPLATE,
                               extra_special_tokens=internvl.TOKENIZER_ATTRIBUTES)
        internvl.build_internvl(out, spec, tok, _save_seeded, VOCAB_SIZE)
        return out
    tok = _build_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    if isinstance(spec, TinyMoESpec):
        _build_moe(out, spec, tok, ids)
    elif isinstance(spec, TinyQwen3_5Spec):
        _build_qwen3_5(out, spec, tok, ids)
    elif isinstance(spec, TinyQwen3Spec):
        _build_qwen3_vl(out, spec, tok, ids)
    else:
        _build_qwen2_5_vl(out, spec, tok, ids)
    tok.save_pretrained(out)
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=ids["<|endoftext|>"], eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                     pad_token_id=ids["<|endoftext|>"], do_sample=False).save_pretrained(out)
    return out


def _seeded_init(model: torch.nn.Module, norm_bias: float = 1.0) -> None:
    """Every parameter from one seeded generator (independent of module init order); a wider init than default
    so the untrained model's outputs are not near-uniform (greedy comparisons need clear argmaxes). Norm weights
    are 1; norm biases `norm_bias` (InternVL's LayerNorms: 0, else a bias of 1 everywhere gives every image token
    one shared direction and the model repeats one token after any image)."""
    import torch

    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name and p.dim() == 1:
                p.fill_(norm_bias if name.endswith(".bias") else 1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.08 if p.dim() >= 2 else 0.02))
    model.eval()


def _text_token_ids(ids: dict[str, int]) -> dict[str, int]:
    """The text config's special tokens (both families use the one embedded tokenizer)."""
    return dict(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])


def _vision_token_ids(ids: dict[str, int]) -> dict[str, int]:
    """The model config's image / video placeholder and delimiter tokens."""
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def _save_seeded(model_class, config, out: Path, norm_bias: float = 1.0) -> None:
    """The model built from `config` with `_seeded_init`'s weights, saved (float32 safetensors) into `out`, its
    experts (MoE) in the layout its family's checkpoints use (what transformers and both engines load)."""
    import torch

    from vlmrl.models.saving import save_model

    config.architectures = [model_class.__name__]
    torch.manual_seed(SEED)
    model = model_class(config).to(torch.float32)
    _seeded_init(model, norm_bias)
    save_model(model, out)


def _build_qwen2_5_vl(out: Path, spec: TinySpec, tok, ids: dict[str, int]) -> None:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    head_dim = spec.text_hidden // spec.text_heads
    assert sum(spec.mrope_section) == head_dim // 2, "mrope sections must sum to head_dim / 2"
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=VOCAB_SIZE, hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
            num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
            num_key_value_heads=spec.text_heads, max_position_embeddings=4096, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "mrope_section": list(spec.mrope_section), "rope_theta": 1e6},
            **_text_token_ids(ids),
            use_sliding_window=False, max_window_layers=spec.text_layers,
        ),
        vision_config=dict(
            depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
            num_heads=spec.vision_heads, in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
            window_size=112, out_hidden_size=spec.text_hidden, fullatt_block_indexes=[spec.vision_depth - 1],
            tokens_per_second=2,
        ),
        **_vision_token_ids(ids),
        tie_word_embeddings=False,
    )
    _save_seeded(Qwen2_5_VLForConditionalGeneration, config, out)

    image_processor = Qwen2VLImageProcessorPil(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels,
                                               patch_size=14, temporal_patch_size=2, merge_size=2)
    # transformers requires a video processor; its implementation needs torchvision (pure-Python in the CPU setup).
    video_processor = Qwen2VLVideoProcessor(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    processor = Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                                    chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)


def _qwen3_vl_config(spec: TinyQwen3Spec, ids: dict[str, int], moe: dict | None = None):
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    assert sum(spec.mrope_section) == spec.head_dim // 2, "mrope sections must sum to head_dim / 2"
    return (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=dict(
            vocab_size=VOCAB_SIZE, hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
            num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
            num_key_value_heads=spec.text_heads, head_dim=spec.head_dim, max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            # the released checkpoints carry mrope_interleaved: the engines interleave only with it (HF always does)
            rope_parameters={"rope_type": "default", "mrope_section": list(spec.mrope_section),
                             "mrope_interleaved": True, "rope_theta": 5e6},
            **_text_token_ids(ids), **(moe or {}),
        ),
        vision_config=dict(
            depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
            num_heads=spec.vision_heads, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
            out_hidden_size=spec.text_hidden, num_position_embeddings=spec.num_position_embeddings,
            deepstack_visual_indexes=list(spec.deepstack_layers),
        ),
        **_vision_token_ids(ids),
        tie_word_embeddings=False,
    )


def _build_qwen3_vl(out: Path, spec: TinyQwen3Spec, tok, ids: dict[str, int]) -> None:
    from transformers import Qwen3VLForConditionalGeneration

    _save_seeded(Qwen3VLForConditionalGeneration, _qwen3_vl_config(spec, ids), out)
    _save_qwen3_vl_processor(out, spec.min_pixels, spec.max_pixels, tok)


def _save_qwen3_vl_processor(out: Path, min_pixels: int, max_pixels: int, tok) -> None:
    """Qwen3-VL's processor (Qwen3.5 ships the same): 16 px patches, mean = std = 0.5 as the released ones."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    image_processor = Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels,
                                               patch_size=16, temporal_patch_size=2, merge_size=2,
                                               image_mean=[0.5] * 3, image_std=[0.5] * 3)
    video_processor = Qwen3VLVideoProcessor(patch_size=16, temporal_patch_size=2, merge_size=2)
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                                 chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(out)


def _qwen3_5_config(spec: TinyQwen3_5Spec, ids: dict[str, int], moe: dict | None = None):
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    from vlmrl.models.families import attention_interval

    rotary = int(spec.head_dim * spec.partial_rotary_factor)
    assert sum(spec.mrope_section) == rotary // 2, "mrope sections must sum to the rotary dims / 2"
    interval = attention_interval({"layer_types": list(spec.layer_types)})
    assert interval is not None, "SGLang builds the layers from full_attention_interval: keep layer_types periodic"
    return (Qwen3_5MoeConfig if moe else Qwen3_5Config)(
        text_config=dict(
            vocab_size=VOCAB_SIZE, hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
            num_hidden_layers=len(spec.layer_types), layer_types=list(spec.layer_types),
            full_attention_interval=interval,  # the released configs carry it, and SGLang reads nothing else
            num_attention_heads=spec.text_heads, num_key_value_heads=spec.text_heads, head_dim=spec.head_dim,
            max_position_embeddings=4096, rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
            linear_key_head_dim=spec.linear_head_dim, linear_value_head_dim=spec.linear_head_dim,
            linear_num_key_heads=spec.linear_key_heads, linear_num_value_heads=spec.linear_value_heads,
            # as the released checkpoints: partial rotary, interleaved mrope flagged for the engines
            rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                             "partial_rotary_factor": spec.partial_rotary_factor,
                             "mrope_section": list(spec.mrope_section), "mrope_interleaved": True},
            **_text_token_ids(ids), **(moe or {}),
        ),
        vision_config=dict(
            depth=spec.vision_depth, hidden_size=spec.vision_hidden, intermediate_size=spec.vision_intermediate,
            num_heads=spec.vision_heads, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
            out_hidden_size=spec.text_hidden, num_position_embeddings=spec.num_position_embeddings,
            deepstack_visual_indexes=[],  # as the released configs: SGLang would assume Qwen3-VL's [8, 16, 24]
        ),
        **_vision_token_ids(ids),
        tie_word_embeddings=False,
    )


def _build_qwen3_5(out: Path, spec: TinyQwen3_5Spec, tok, ids: dict[str, int]) -> None:
    from transformers import Qwen3_5ForConditionalGeneration

    _save_seeded(Qwen3_5ForConditionalGeneration, _qwen3_5_config(spec, ids), out)
    _save_qwen3_vl_processor(out, spec.min_pixels, spec.max_pixels, tok)


def _build_moe(out: Path, spec: TinyMoESpec, tok, ids: dict[str, int]) -> None:
    """The dense variant's config with every decoder MLP a mixture of experts (`norm_topk_prob`: the engines read
    it; transformers always renormalises the top-k weights)."""
    moe = dict(num_experts=spec.experts, num_experts_per_tok=spec.top_k, moe_intermediate_size=spec.expert_intermediate,
               norm_topk_prob=True)
    if isinstance(spec.base, TinyQwen3_5Spec):
        from transformers import Qwen3_5MoeForConditionalGeneration

        moe["shared_expert_intermediate_size"] = spec.shared_expert_intermediate
        _save_seeded(Qwen3_5MoeForConditionalGeneration, _qwen3_5_config(spec.base, ids, moe), out)
    else:
        from transformers import Qwen3VLMoeForConditionalGeneration

        moe.update(decoder_sparse_step=1, mlp_only_layers=[])  # every layer sparse
        _save_seeded(Qwen3VLMoeForConditionalGeneration, _qwen3_vl_config(spec.base, ids, moe), out)
    _save_qwen3_vl_processor(out, spec.base.min_pixels, spec.base.max_pixels, tok)


def _build_glm4v(out: Path, spec: TinyGlm4vSpec) -> None:
    """A GLM-4.1V (`glm4v`) with GLM's special tokens, chat template and stop tokens (EOS, <|user|>,
    <|observation|>). Its config carries `text_config.attention_bias: true`, as the released ones do: transformers'
    GLM-4.1V text attention always has q/k/v biases, and vLLM builds them only when the config says so."""
    from transformers import GenerationConfig, Glm4vConfig, Glm4vForConditionalGeneration, Glm4vProcessor
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    tok = _build_tokenizer(GLM_SPECIAL_TOKENS, GLM_CHAT_TEMPLATE, eos="<|endoftext|>",
                           extra_special_tokens={"image_token": "<|image|>", "video_token": "<|video|>"})
    ids = {t: tok.convert_tokens_to_ids(t) for t in GLM_SPECIAL_TOKENS}
    stops = [ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]]
    rotary = int(spec.head_dim * spec.partial_rotary_factor)
    assert sum(spec.mrope_section) == rotary // 2, "mrope sections must sum to the rotary dims / 2"
    config = Glm4vConfig(
        text_config=dict(
            vocab_size=VOCAB_SIZE, hidden_size=spec.text_hidden, intermediate_size=spec.text_intermediate,
            num_hidden_layers=spec.text_layers, num_attention_heads=spec.text_heads,
            num_key_value_heads=spec.text_heads, head_dim=spec.head_dim, max_position_embeddings=4096,
            rms_norm_eps=1e-5, attention_bias=True, eos_token_id=stops, pad_token_id=ids["<|endoftext|>"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": spec.partial_rotary_factor,
                             "mrope_section": list(spec.mrope_section)}),
        vision_config=dict(depth=spec.vision_depth, hidden_size=spec.vision_hidden, num_heads=spec.vision_heads,
                           intermediate_size=spec.vision_intermediate, image_size=spec.vision_image_size,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                           out_hidden_size=spec.text_hidden),
        image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
        image_start_token_id=ids["<|begin_of_image|>"], image_end_token_id=ids["<|end_of_image|>"],
        video_start_token_id=ids["<|begin_of_video|>"], video_end_token_id=ids["<|end_of_video|>"],
        tie_word_embeddings=False,
    )
    _save_seeded(Glm4vForConditionalGeneration, config, out)
    config_path = out / "config.json"  # transformers 5.19 leaves attention_bias out of the saved text_config
    saved = json.loads(config_path.read_text())
    saved["text_config"]["attention_bias"] = True
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    size = {"shortest_edge": 2 * spec.min_pixels, "longest_edge": 2 * spec.max_pixels}  # counts t = 2 copies
    image_processor = Glm4vImageProcessorPil(size=size, patch_size=14, temporal_patch_size=2, merge_size=2)
    video_processor = Glm4vVideoProcessor(size=size, patch_size=14, temporal_patch_size=2, merge_size=2)
    Glm4vProcessor(image_processor=image_processor, tokenizer=tok, video_processor=video_processor,
                   chat_template=GLM_CHAT_TEMPLATE).save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig(eos_token_id=stops, pad_token_id=ids["<|endoftext|>"], do_sample=False).save_pretrained(out)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Build an embedded tiny Qwen-VL model (no hub access).")
    parser.add_argument("out_dir", nargs="?", help="target folder (default: the cache; prints its path)")
    parser.add_argument("--variant", default="tiny", choices=sorted(VARIANTS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    print(build(args.out_dir, args.variant) if args.out_dir else ensure_built(args.variant))


if __name__ == "__main__":
    main()
