"""The loop profiler's parts (``tools/profile_loop.py``): sampling from outside the processes,
then attribution of what was sampled to the loop's phases and the engine's decode steps."""
