"""The reward pool: :mod:`.reward_pool` is its facade (the only part callers use), the other
modules one concern each (its docstring lists them)."""
