"""Where extensions are named: rollout schedulers and plug-in factories.

A scheduler is named by ``scheduler.name``: a registered short name (``baseline`` here;
RollPacker registers ``tail_batching``) or an import path ``package.module:Class`` of a
:class:`~megatron_rl.loop.hooks.RolloutScheduler` subclass, the way slime names its rollout and
reward functions. Plug-in factories (:data:`~megatron_rl.loop.hooks.PluginFactory`) are registered by
packages (RollPacker's builds the elastic-TP planner and the stream trainer from its config
sections) or named in ``trainer.plugins`` as import paths ``package.module:function``.

Registering happens when a package's registration module is imported. Packages name those
modules in the entry-point group ``megatron_rl.plugins`` of their distribution (the way vLLM
loads ``vllm.general_plugins``), and :func:`load_plugin_packages` imports every one before a
config is parsed (``config.loading.load_config`` calls it), so a package's own config sections,
validators and scheduler names are known to the parser: ``peers.partial.max_continuations=2``
works on the command line like a core key. RollPacker registers itself this way
(``rollpacker`` and ``rollpacker_peers`` in pyproject.toml), exactly as a third-party package
would; the core names no plug-in package. ``MEGATRON_RL_PLUGINS`` (comma-separated entry-point
names) restricts which are loaded. Nothing else here imports a plug-in until it is used.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
from typing import Any

from megatron_rl.config.schema import RunConfig

_SCHEDULERS: dict[str, str] = {"baseline": "megatron_rl.loop.baseline:BaselineScheduler"}
_FACTORIES: list[str] = []
_LOADED: dict[str, str] = {}
"""Entry points loaded so far: name -> value."""

ENTRY_POINT_GROUP = "megatron_rl.plugins"
"""Distributions list their registration modules (or functions) here."""

log = logging.getLogger(__name__)


class PluginError(ValueError):
    """A scheduler or plug-in that cannot be found or built; the message names the config key."""


def register_scheduler(name: str, path: str) -> None:
    """Make ``scheduler.name=<name>`` build the class at import path ``path`` ('module:Class')."""
    if _SCHEDULERS.get(name, path) != path:
        raise ValueError(f"scheduler {name!r} is already registered as {_SCHEDULERS[name]}")
    _SCHEDULERS[name] = path


def register_plugin_factory(path: str) -> None:
    """Call the factory at ``path`` ('module:function') for every run (idempotent)."""
    if path not in _FACTORIES:
        _FACTORIES.append(path)


def load_plugin_packages() -> list[str]:
    """Import every registration module of the ``megatron_rl.plugins`` entry-point group (an entry
    point naming a function is called, with no arguments), the ones named in
    ``MEGATRON_RL_PLUGINS`` only when that is set. Each loads once per process; later calls pick
    up distributions that appeared since (cheap: a metadata scan). Returns the names loaded so
    far. A registration that fails to import is a PluginError naming it."""
    allowed = os.environ.get("MEGATRON_RL_PLUGINS")
    names = None if allowed is None else {n.strip() for n in allowed.split(",") if n.strip()}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if entry.name in _LOADED or (names is not None and entry.name not in names):
            continue
        try:
            registered = entry.load()
        except Exception as exc:
            raise PluginError(f"plug-in package {entry.name!r} ({entry.value}, entry point group "
                              f"{ENTRY_POINT_GROUP}) failed to load: {type(exc).__name__}: {exc}") from exc
        if callable(registered) and not isinstance(registered, type):
            registered()
        _LOADED[entry.name] = entry.value
        log.debug("loaded plug-in package %s (%s)", entry.name, entry.value)
    return sorted(_LOADED)


def scheduler_names() -> list[str]:
    """Registered scheduler short names."""
    return sorted(_SCHEDULERS)


def load_object(path: str, key: str) -> Any:
    """The object at import path ``'package.module:attribute'``; errors name ``key``."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise PluginError(f"{key}: expected a registered name or an import path 'package.module:attribute', "
                          f"got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PluginError(f"{key}: cannot import {module_name!r} ({exc})") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PluginError(f"{key}: {module_name!r} has no attribute {attr!r}") from None


def scheduler_path(name: str) -> str:
    """The import path ``scheduler.name`` stands for; raises PluginError when it names nothing."""
    if name in _SCHEDULERS:
        return _SCHEDULERS[name]
    if ":" in name:
        return name
    raise PluginError(f"scheduler.name: {name!r} is not a registered scheduler ({', '.join(scheduler_names())}) "
                      "nor an import path 'package.module:Class'")


def make_scheduler(cfg: RunConfig):
    """A new instance of the scheduler ``scheduler.name`` names (a ``hooks.RolloutScheduler``;
    checked by its interface so this registry stays below the loop in the layering)."""
    cls = load_object(scheduler_path(cfg.scheduler.name), "scheduler.name")
    if not (isinstance(cls, type) and callable(getattr(cls, "next_batch", None))):
        raise PluginError(f"scheduler.name: {cfg.scheduler.name!r} is not a RolloutScheduler (no next_batch)")
    return cls()


def plugin_factories(cfg: RunConfig) -> list[Any]:
    """The registered factories, then those named in ``trainer.plugins``, loaded."""
    extra = [p.strip() for p in cfg.trainer.plugins.split(",") if p.strip()]
    factories = []
    for path in _FACTORIES + [p for p in extra if p not in _FACTORIES]:
        factory = load_object(path, "trainer.plugins")
        if not callable(factory):
            raise PluginError(f"trainer.plugins: {path!r} is not callable")
        factories.append(factory)
    return factories
