"""What every reader of a config value shares: the error that names the key, and the parser of
comma-separated values (core and plug-in sections alike)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, with the dotted key it concerns in the message."""


def comma_list(spec: str) -> list[str]:
    """A comma-separated config value (e.g. stream.rounds 'long,short') as a list of stripped items."""
    return [r.strip() for r in spec.split(",") if r.strip()]
