"""RL algorithm math, pure tensor functions: advantage estimators (`advantages`), policy losses (`policy_loss`,
`grpo`), loss aggregation (`aggregation`), KL, entropy, chunked response logprobs (`logprobs`), rollout correction
(`correction`) and DAPO's data helpers (`dapo`). The loop selects them by name (the *_FNS registries and name
tuples)."""
