"""Errors of remote parts in one line, for messages that name the part that failed.

A Ray task error carries the remote traceback in its text (dozens of lines); an actor's death
carries a paragraph of advice. What a failure report needs is the part's own exception and Ray's
reason for a death ("its worker process has died", "its node has died")."""
from __future__ import annotations

import re

_REASON = re.compile(r"The actor (?:is dead|died) because [^.]*\.")


def one_line(exc: BaseException, limit: int = 600) -> str:
    """``Type: message`` of ``exc`` in one line: a Ray task error's own cause without the remote
    traceback, an actor death's first line and Ray's reason."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):  # ray.exceptions.RayTaskError: the exception the task raised
        exc = cause
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reasons = [m.group(0) for line in lines[1:] for m in [_REASON.search(line)] if m]
    return f"{type(exc).__name__}: {' '.join(lines[:1] + reasons)}"[:limit]
