"""The loop profiler's parts (``rollpacker-profile-loop``): sampling from outside the processes,
then attribution of what was sampled to the loop's phases and the engine's decode steps."""
