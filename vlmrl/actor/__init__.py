"""The policy being trained: its construction, logprobs and update (the run config's `actor` section)."""
