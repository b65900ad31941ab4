"""vlmrl: VLM-first RL fine-tuning with SGLang and vLLM behind one rollout interface."""

__version__ = "0.1.0"
