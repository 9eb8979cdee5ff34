"""The loop profiler's parts (RollPacker's ``rollpacker-profile-loop`` runs them over its benchmark
columns): sampling from outside the processes, then attribution of what was sampled to the loop's
phases and the engine's decode steps; ``command_cpu``: the CPU a command's processes use."""
