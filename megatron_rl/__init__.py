"""megatron_rl: a synchronous, strictly on-policy RL trainer on Megatron-Core + vLLM + Ray."""
