"""What every embedded tiny model is built from: the committed byte-level BPE with a family's special tokens and chat
template, one seeded generator for every parameter, and the one writer of model folders (`save_model`).

Each family's builder module (`vlmrl.models.tiny.<family>`, named by the family's `tiny_builder`) uses these; the
Qwen families share Qwen's tokens and ChatML template, GLM-4.1V and InternVL add their own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a model is built: the launcher resolves names without it
    import torch

ASSETS = Path(__file__).parents[1] / "tiny_assets"
"""vocab.json and merges.txt of the embedded BPE (made by scripts/make_tiny_tokenizer.py)."""
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
class TinyMoESpec:
    """A MoE variant: a dense variant's shapes with every decoder MLP a mixture of experts."""

    base: Any
    """The dense variant's spec (Qwen3-VL's or Qwen3.5's)."""
    experts: int
    top_k: int
    expert_intermediate: int
    """Keep 2 x expert_intermediate != text_hidden: a transposed expert tensor then cannot load."""
    shared_expert_intermediate: int = 0
    """Qwen3.5-MoE's gated shared expert (0: none, Qwen3-VL-MoE)."""

    def text_config(self) -> dict[str, Any]:
        """The text config's expert keys (`norm_topk_prob`: the engines read it; transformers always renormalises
        the top-k weights)."""
        return dict(num_experts=self.experts, num_experts_per_tok=self.top_k,
                    moe_intermediate_size=self.expert_intermediate, norm_topk_prob=True)


def build_tokenizer(special: list[str] = SPECIAL_TOKENS, template: str = CHAT_TEMPLATE, eos: str = "<|im_end|>",
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


def qwen_tokenizer():
    """(the embedded tokenizer with Qwen's tokens and template, {special token: id})."""
    tok = build_tokenizer()
    return tok, {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def text_token_ids(ids: dict[str, int]) -> dict[str, int]:
    """The text config's special tokens (the Qwen families use the one embedded tokenizer)."""
    return dict(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])


def vision_token_ids(ids: dict[str, int]) -> dict[str, int]:
    """The model config's image / video placeholder and delimiter tokens (Qwen's)."""
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def seeded_init(model: torch.nn.Module, norm_bias: float = 1.0) -> None:
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


def save_seeded(model_class, config, out: Path, norm_bias: float = 1.0) -> None:
    """The model built from `config` with `seeded_init`'s weights, saved (float32 safetensors) into `out`, its
    experts (MoE) in the layout its family's checkpoints use (what transformers and both engines load)."""
    import torch

    from vlmrl.models.saving import save_model

    config.architectures = [model_class.__name__]
    torch.manual_seed(SEED)
    model = model_class(config).to(torch.float32)
    seeded_init(model, norm_bias)
    save_model(model, out)


def save_qwen_tokenizer(out: Path, tok, ids: dict[str, int]) -> None:
    """The tokenizer and a greedy generation config stopping at `<|im_end|>` or `<|endoftext|>` (Qwen's)."""
    from transformers import GenerationConfig

    tok.save_pretrained(out)
    GenerationConfig(bos_token_id=ids["<|endoftext|>"], eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                     pad_token_id=ids["<|endoftext|>"], do_sample=False).save_pretrained(out)
