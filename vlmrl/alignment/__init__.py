"""Backend alignment: the validation artifact, a pure diff of two artifacts, and reports (terminal, JSON, HTML).

`python -m vlmrl.alignment.compare A.jsonl B.jsonl` or `python -m vlmrl.alignment.compare --backends vllm,sglang ...`.
"""

from vlmrl.alignment.artifact import (
    ArtifactError,
    ArtifactMeta,
    DatasetIdentity,
    ValidationRecord,
    read_artifact,
    records_from_rollout,
    write_artifact,
)

__all__ = [
    "ArtifactError",
    "ArtifactMeta",
    "DatasetIdentity",
    "ValidationRecord",
    "read_artifact",
    "records_from_rollout",
    "write_artifact",
]
