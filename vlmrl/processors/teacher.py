"""Can this teacher score this student's samples? The check on-policy distillation makes before anything starts.

The teacher scores the student's token ids and image tokens as they are (`algorithm.distill`): its logprobs are of
the same prompt only when both models read ids the same way. So the two must be of one family (the same chat
template, image layout and placeholder expansion), with the same tokenizer vocabulary (every token string to the
same id, special and added tokens included) and the same image/video token ids in their configs. Another size of the
family is the normal case: Qwen2.5-VL 3B and 7B share all of that, though their configs' vocab_size differ (151936 vs
152064: the embedding is padded to another multiple, rows no token id reaches), so vocab_size is not compared.
"""

from __future__ import annotations

import logging
from pathlib import Path

from vlmrl.models.families import family_for_path, read_model_config

logger = logging.getLogger(__name__)


def _image_token_ids(model_dir: str) -> dict[str, int]:
    """The config's image / video / vision token ids (top level and text_config), by key."""
    config = read_model_config(model_dir)
    found = {}
    for scope in (config, config.get("text_config") or {}):
        for key, value in scope.items():
            if key.endswith("_token_id") and any(word in key for word in ("image", "video", "vision")):
                found.setdefault(key, value)
    return found


def _vocabulary(model_dir: str) -> tuple[dict[str, int], dict[str, str]]:
    """The tokenizer's token -> id map (added tokens included) and its special tokens by role."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.get_vocab(), {role: str(token) for role, token in tokenizer.special_tokens_map.items()}


def teacher_mismatch(student_dir: str, teacher_dir: str) -> str | None:
    """What differs between the student's and the teacher's model folders that would make the teacher score other
    ids than the student sampled (its family, tokenizer vocabulary, special tokens or image/video token ids), in a
    few words; None when the teacher can score the student's samples."""
    student_family, teacher_family = family_for_path(student_dir), family_for_path(teacher_dir)
    if student_family is not teacher_family:
        return f"the model family differs ({teacher_family.name} vs the student's {student_family.name})"
    student_ids, teacher_ids = _image_token_ids(student_dir), _image_token_ids(teacher_dir)
    differing = sorted(key for key in student_ids.keys() | teacher_ids.keys()
                       if student_ids.get(key) != teacher_ids.get(key))
    if differing:
        key = differing[0]
        return f"{key} differs ({teacher_ids.get(key)} vs the student's {student_ids.get(key)})"
    (student_vocab, student_special), (teacher_vocab, teacher_special) = _vocabulary(student_dir), _vocabulary(
        teacher_dir)
    if student_vocab != teacher_vocab:
        other = sorted(token for token in student_vocab.keys() | teacher_vocab.keys()
                       if student_vocab.get(token) != teacher_vocab.get(token))
        return (f"the tokenizer vocabulary differs ({len(teacher_vocab)} vs the student's {len(student_vocab)} "
                f"tokens; {len(other)} map differently, e.g. {other[0]!r})")
    if student_special != teacher_special:
        role = sorted(r for r in student_special.keys() | teacher_special.keys()
                      if student_special.get(r) != teacher_special.get(r))[0]
        return f"the special token {role} differs ({teacher_special.get(role)!r} vs the student's " \
               f"{student_special.get(role)!r})"
    return None


def teacher_refusal(student: str, teacher: str) -> str | None:
    """One line refusing `teacher` for `student` (both as configured: folders, embedded names or hub ids), or None
    when it may teach. A hub id that is not downloaded yet is not checked here (logged); it is when the trainer
    loads it."""
    from vlmrl.models.tiny import is_embedded, is_hub_id, resolve_model_path

    local = [name for name in (student, teacher) if is_embedded(name) or Path(name).expanduser().is_dir()]
    if len(local) < 2:
        missing = [name for name in (student, teacher) if name not in local]
        unknown = [name for name in missing if not is_hub_id(name)]
        if unknown:
            return f"algorithm.distill.teacher: model {unknown[0]!r} is no folder, embedded name or hub id"
        logger.info("teacher %s / student %s: %s not local yet, checked when the trainer loads it", teacher, student,
                    ", ".join(missing))
        return None
    mismatch = teacher_mismatch(resolve_model_path(student), resolve_model_path(teacher))
    if mismatch is None:
        return None
    return (f"algorithm.distill.teacher={teacher} cannot score the samples of actor.model_path={student}: {mismatch}; "
            "a teacher must be of the student's family with the same vocabulary (another size of it, e.g. "
            "Qwen2.5-VL-7B for a 3B student)")
