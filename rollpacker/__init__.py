"""RollPacker policies (tail batching, planner, reward scheduler, stream trainer) plugged into megatron_rl."""
