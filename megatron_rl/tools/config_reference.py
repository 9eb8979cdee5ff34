"""Print the configuration reference (every section and field with its default and docstring)
as Markdown, straight from the config dataclasses (megatron_rl/config.py, then the sections
plug-in packages register, e.g. rollpacker/config.py), so the README cannot drift from the code.

    megatron-rl-config-reference                    # print
    megatron-rl-config-reference --check README.md  # exit 1 if README's copy is stale
    bash tools/update_readme_config.sh              # rewrite README's copy

The sections are those ``megatron-rl-train`` accepts: the installed plug-in packages register
them (``megatron_rl.plugins.load_plugin_packages``, RollPacker's among them), so this module
names no plug-in package itself.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
from pathlib import Path

import megatron_rl.config as config_module
from megatron_rl.config import RunConfig, plugin_sections
from megatron_rl.plugins import load_plugin_packages

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def field_docs(module=config_module) -> dict[str, dict[str, str]]:
    """{class name: {field: docstring}} read from a module's source (dataclass fields keep no docs)."""
    tree = ast.parse(inspect.getsource(module))
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            body, fields = node.body, {}
            for i, stmt in enumerate(body[:-1]):
                nxt = body[i + 1]
                if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                    fields[stmt.target.id] = " ".join(str(nxt.value.value).split())
            docs[node.name] = fields
    return docs


def _sections() -> list[tuple[str, str, type, dict[str, str]]]:
    """(name, description, dataclass, field docs) of the core sections, then the plug-in ones."""
    load_plugin_packages()  # the plug-in packages' sections, as a training run has them
    core_docs = field_docs()
    out = [(f.name, core_docs["RunConfig"][f.name], type(getattr(RunConfig(), f.name)), core_docs)
           for f in dataclasses.fields(RunConfig) if f.name != "extensions"]
    for name, (cls, description) in sorted(plugin_sections().items()):
        out.append((name, f"{description} (registered by `{cls.__module__}`)", cls,
                    field_docs(sys.modules[cls.__module__])))
    return out


def _field_rows(prefix: str, cls: type, obj, docs: dict[str, dict[str, str]]) -> list[str]:
    """One table row per field; a nested section (e.g. ``rollout.speculative``) gets its fields as
    ``prefix.section.field`` rows right after it."""
    rows = []
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        text = docs[cls.__name__][f.name].replace("|", "\\|")
        if dataclasses.is_dataclass(value):
            rows.append(f"| `{prefix}.{f.name}.*` | | {text} |")
            # A nested section's class may live in another module than its parent's.
            rows += _field_rows(f"{prefix}.{f.name}", type(value), value, field_docs(sys.modules[type(value).__module__]))
        else:
            rows.append(f"| `{prefix}.{f.name}` | `{value!r}` | {text} |")
    return rows


def render() -> str:
    lines = []
    for name, description, cls, docs in _sections():
        obj = cls()
        lines += [f"**`{name}`**: {description}", "",
                  "| key | default | meaning |", "| --- | --- | --- |"]
        lines += _field_rows(name, cls, obj, docs)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", metavar="README", help="fail if the README's reference block differs")
    args = parser.parse_args()
    text = render()
    if not args.check:
        print(text, end="")
        return 0
    readme = Path(args.check).read_text()
    if BEGIN not in readme or END not in readme:
        print(f"{args.check}: no {BEGIN} ... {END} block", file=sys.stderr)
        return 1
    current = readme.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"
    if current != text:
        print(f"{args.check}: the config reference is stale; regenerate with bash tools/update_readme_config.sh",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
