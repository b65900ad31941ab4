"""Backend alignment: the validation artifact (`artifact`), a pure diff of two artifacts (`diff`), and reports
(terminal, JSON, HTML).

`python -m vlmrl.alignment.compare A.jsonl B.jsonl` or `python -m vlmrl.alignment.compare --backends vllm,sglang ...`.
"""
