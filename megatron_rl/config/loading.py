"""Load a YAML recipe into :class:`RunConfig` and apply dotted ``section.field=value`` overrides.

Every error is a :class:`~megatron_rl.config.values.ConfigError` whose message names the offending key
(``data.prompts_per_step``) and, for files, the file. Validation (``config.validation``) runs next, before Ray,
Megatron or vLLM start.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config.plugins import PluginError, load_plugin_packages
from megatron_rl.config.schema import RunConfig, plugin_sections
from megatron_rl.config.values import ConfigError


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, typ: Any, key: str, from_string: bool) -> Any:
    """Convert ``value`` to ``typ`` or raise naming ``key``. Strings from the CLI are parsed.
    ``X | None`` fields take null (YAML ``null``, ``key=null`` on the command line) or an X."""
    args = typing.get_args(typ)
    if type(None) in args and len(args) == 2:
        if value is None or (from_string and isinstance(value, str) and value.strip().lower() in ("null", "none", "~")):
            return None
        return _coerce(value, next(a for a in args if a is not type(None)), key, from_string)
    if from_string and isinstance(value, str) and typ is not str:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{key}: cannot parse {value!r}: {exc}") from None
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads '1e-5' (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif typ is str:
        if isinstance(value, str):
            return value
        if from_string and value is not None:
            return str(value)
    else:  # pragma: no cover - only the four scalar types are used in RunConfig
        raise ConfigError(f"{key}: unsupported field type {typ}")
    raise ConfigError(f"{key}: expected {typ.__name__}, got {type(value).__name__} {value!r}")


def section_names(cfg: RunConfig) -> list[str]:
    """Every section a recipe may set: the core ones, then the registered plug-in sections."""
    core = [f.name for f in dataclasses.fields(RunConfig) if f.name != "extensions"]
    return core + sorted(plugin_sections())


def _unknown_key(key: str, source: str, known_here: list[str]) -> ConfigError:
    """The error for a key its section does not have; it names the keys of the same name in other
    sections (a key that moved to another section, e.g. into a plug-in's own)."""
    name = key.rsplit(".", 1)[-1]
    elsewhere: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for field_name, typ in _field_types(cls).items():
            dotted = f"{prefix}.{field_name}"
            if dataclasses.is_dataclass(typ):
                walk(typ, dotted)
            elif field_name == name and dotted != key:
                elsewhere.append(dotted)

    sections = {f.name: typing.get_type_hints(RunConfig)[f.name] for f in dataclasses.fields(RunConfig)
                if f.name != "extensions"}
    sections.update({section: cls for section, (cls, _) in plugin_sections().items()})
    for section, cls in sections.items():
        walk(cls, section)
    hint = f"; did you mean {' or '.join(repr(k) for k in sorted(elsewhere))}?" if elsewhere else ""
    return ConfigError(f"unknown key '{key}' in {source} (known here: {', '.join(sorted(known_here))}){hint}")


def _section(cfg: RunConfig, name: str, where: str) -> Any:
    if name not in section_names(cfg):
        raise ConfigError(f"unknown section '{name}' in {where} (sections: {', '.join(section_names(cfg))})")
    return getattr(cfg, name)


def _apply_mapping(obj: Any, mapping: dict, prefix: str, source: str) -> None:
    if not isinstance(mapping, dict):
        raise ConfigError(f"{prefix or 'top level'} in {source}: expected a mapping, got {mapping!r}")
    if isinstance(obj, RunConfig):
        for name, value in mapping.items():
            _apply_mapping(_section(obj, str(name), source), value, str(name), source)
        return
    types = _field_types(type(obj))
    for name, value in mapping.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in types:
            raise _unknown_key(key, source, list(types))
        current = getattr(obj, name)
        if dataclasses.is_dataclass(current):
            _apply_mapping(current, value, key, source)
        else:
            setattr(obj, name, _coerce(value, types[name], key, from_string=False))


def apply_override(cfg: RunConfig, assignment: str) -> None:
    """Apply one ``section.field=value`` override (value parsed as YAML scalar)."""
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like section.field=value")
    dotted, raw = assignment.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) < 2:
        raise ConfigError(f"override {assignment!r} must look like section.field=value")
    obj: Any = _section(cfg, parts[0], "command-line override")
    for i, part in enumerate(parts[1:], start=1):
        key = ".".join(parts[: i + 1])
        types = _field_types(type(obj))
        if part not in types:
            raise _unknown_key(key, "command-line override", list(types))
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(getattr(obj, part)):
                raise ConfigError(f"'{key}' is a section; override one of its fields")
            setattr(obj, part, _coerce(raw, types[part], key, from_string=True))
        else:
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                raise ConfigError(f"'{key}' is a field, not a section")


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> RunConfig:
    """Read a recipe (or start from defaults when ``path`` is None) and apply overrides. The
    installed plug-in packages register their sections first (``plugins.load_plugin_packages``),
    so their keys parse like the core's."""
    try:
        load_plugin_packages()
    except PluginError as exc:
        raise ConfigError(str(exc)) from None
    cfg = RunConfig()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: invalid YAML: {exc}") from None
        _apply_mapping(cfg, data, "", str(p))
    for assignment in overrides:
        apply_override(cfg, assignment)
    return cfg


def config_to_dict(cfg: RunConfig) -> dict:
    """The configuration as plain data, every section (core and plug-in) at the top level: what
    run_dir/config.json, checkpoint manifests and W&B get, and what :func:`load_config` reads."""
    data = dataclasses.asdict(cfg)
    data.update(data.pop("extensions"))
    return data
