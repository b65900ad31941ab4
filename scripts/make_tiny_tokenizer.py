"""Regenerate vlmrl/models/tiny_assets/{vocab.json,merges.txt}: the embedded tiny model's byte-level BPE.

The OUTPUT is committed, so building the tiny model never depends on the `tokenizers` version's BPE trainer.
The corpus is written below (English for the synthetic visual tasks, geometry/maths words, LaTeX answers), so
the result is reproducible from this file alone. Run: python scripts/make_tiny_tokenizer.py
"""
import json
import pathlib

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

OUT = pathlib.Path(__file__).resolve().parent.parent / "vlmrl" / "models" / "tiny_assets"
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white", "gray", "pink", "brown", "cyan"]
SHAPES = ["square", "circle", "triangle", "star", "cross", "ring", "diamond"]
WORDS = ["left", "right", "top", "bottom", "middle", "center", "above", "below", "count", "how", "many", "what",
         "which", "where", "is", "the", "a", "an", "of", "in", "image", "picture", "shape", "colour", "color", "answer",
         "with", "one", "word", "number", "only", "there", "are", "and", "or", "yes", "no", "first", "second", "third",
         "angle", "triangle", "length", "area", "perimeter", "radius", "diameter", "degrees", "find", "measure", "side",
         "line", "segment", "parallel", "perpendicular", "point", "points", "value", "solve", "given", "figure",
         "think", "step", "by", "so", "then", "therefore", "because", "final", "boxed", "You", "are", "helpful",
         "assistant", "system", "user", "Describe", "this", "Look", "at", "reason", "about", "put", "your"]


def corpus() -> list[str]:
    lines = []
    for c in COLOURS:
        for s in SHAPES:
            lines.append(f"What colour is the {s}? Answer with one word. The {s} is {c}. {c} {c.capitalize()}")
    for n in range(0, 200):
        lines.append(f"How many shapes are there? There are {n} shapes. The answer is \\boxed{{{n}}}.")
        lines.append(f"Find x. x = {n} degrees. angle ABC = {n}. The length of side AB is {n / 4:.2f}.")
    lines.append(" ".join(WORDS) * 4)
    lines.append("<think> Let me think step by step. </think> The final answer is \\boxed{42}. \\frac{1}{2} \\sqrt{3} \\pi")
    lines.append("You are a helpful assistant. Describe this image. Look at the picture and answer the question.")
    # Answers start the assistant turn (no leading space): put every answer word on its own line too.
    lines.extend(f"{w}\n{w.capitalize()}\n" for w in COLOURS + SHAPES + WORDS)
    lines.extend(f"{n}\n" for n in range(100))
    return lines * 3


def main() -> None:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=900, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(corpus(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "vocab.json").write_text(json.dumps(model["vocab"], ensure_ascii=False, sort_keys=True, indent=0) + "\n")
    (OUT / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    print(f"vocab {len(model['vocab'])} merges {len(merges)} -> {OUT}")


if __name__ == "__main__":
    main()
