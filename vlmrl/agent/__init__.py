"""Multi-turn rollout with tools (images in and out) and partial rollout; see docs/agent.md.

- `config`: `AgentConfig` (torch-free: the run config composes it); `loop`: `AgentLoop`, `AgentBatch`, `Group`;
- `parser`: tool calls out of a response; `tools`: the tool registry; `trajectory`: one conversation's record;
- `carry`: partial rollout's carried groups; `batcher`: the engine calls of many conversations at once.
"""
