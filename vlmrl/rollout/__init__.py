"""Rollout backends behind one interface: `hf` (transformers reference), `vllm`, `sglang` (in-process Engine) and
`sglang-server` (HTTP, launched by vlmrl on 127.0.0.1 or given by URL).

- `base`: the contract (`RolloutBackend`, `BackendOptions`); `errors`: the errors a backend raises;
- `registry`: a backend by name (`get_backend`), or from a run's rollout section (`start_backend`);
- `config`: the rollout section (torch-free); `hf`, `vllm`, `sglang`, `sglang_server`: one backend each.

Each engine is imported lazily, in exactly one module (`vlmrl.rollout.vllm`, `vlmrl.rollout.sglang`), only when
that backend is created.
"""
