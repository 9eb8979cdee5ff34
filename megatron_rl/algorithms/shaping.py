"""Reward shaping applied to a response's rule reward before advantages are computed.

DAPO's soft overlong punishment: responses that run into the last ``buffer`` tokens of the
generation budget lose reward linearly, and responses that reach the budget lose the whole
``penalty``. It discourages rambling without the cliff of a hard truncation penalty.
"""
from __future__ import annotations


def overlong_penalty(length: int, max_length: int, buffer: int, penalty: float) -> float:
    """DAPO soft overlong punishment for a response of ``length`` tokens (a value <= 0).

    With ``start = max_length - buffer``:

    * ``length <= start``: 0
    * ``start < length < max_length``: ``-(length - start) / buffer * penalty``
    * ``length >= max_length``: ``-penalty``

    ``buffer == 0`` disables the punishment (always 0).
    """
    if buffer < 0 or buffer > max_length:
        raise ValueError(
            f"algorithm.overlong_buffer_tokens={buffer} must lie in [0, max_new_tokens={max_length}]"
        )
    if penalty < 0:
        raise ValueError(f"algorithm.overlong_penalty={penalty} must be >= 0 (it is subtracted)")
    if buffer == 0:
        return 0.0
    start = max_length - buffer
    if length <= start:
        return 0.0
    if length >= max_length:
        return -float(penalty)
    return -(length - start) / buffer * penalty


def shaped_reward(raw_reward: float, length: int, max_length: int, buffer: int, penalty: float) -> float:
    """``raw_reward`` plus the overlong punishment for ``length`` (see :func:`overlong_penalty`)."""
    return raw_reward + overlong_penalty(length, max_length, buffer, penalty)
