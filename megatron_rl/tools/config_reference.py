"""Print the configuration reference (every section and field with its default and docstring)
as Markdown, straight from the config dataclasses (megatron_rl/config/schema.py, then the sections
plug-in packages register, e.g. rollpacker/config.py), so the reference page cannot drift from
the code. The page (docs/configuration.md) holds the table between two marker lines.

    megatron-rl-config-reference                                 # print
    megatron-rl-config-reference --check docs/configuration.md   # exit 1 if the page's copy is stale
    megatron-rl-config-reference --write docs/configuration.md   # rewrite the page's copy
    bash tools/update_config_reference.sh                        # the same, for docs/configuration.md

The sections are those ``megatron-rl-train`` accepts: the installed plug-in packages register
them (``megatron_rl.config.plugins.load_plugin_packages``, RollPacker's among them), so this module
names no plug-in package itself.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
from pathlib import Path

import megatron_rl.config.schema as config_module
from megatron_rl.config.plugins import load_plugin_packages
from megatron_rl.config.schema import RunConfig, plugin_sections

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
    """One bullet per field, wrapped so that no line passes 150 characters; a nested section (e.g.
    ``rollout.speculative``) gets its fields as ``prefix.section.field`` bullets right after it."""
    rows = []
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        text = docs[cls.__name__][f.name]
        if dataclasses.is_dataclass(value):
            rows.append(_bullet(f"`{prefix}.{f.name}.*`: {text}"))
            # A nested section's class may live in another module than its parent's.
            rows += _field_rows(f"{prefix}.{f.name}", type(value), value, field_docs(sys.modules[type(value).__module__]))
        else:
            rows.append(_bullet(f"`{prefix}.{f.name}` (default `{value!r}`): {text}"))
    return rows


def _bullet(text: str) -> str:
    return textwrap.fill(f"* {text}", width=150, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)


def render() -> str:
    lines = []
    for name, description, cls, docs in _sections():
        obj = cls()
        lines += [f"**`{name}`**: {description}", ""]
        lines += _field_rows(name, cls, obj, docs)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _split(page: str) -> tuple[str, str, str] | None:
    """(text up to and including BEGIN, the block, text from END on), or None without both markers."""
    if BEGIN not in page or END not in page.split(BEGIN, 1)[1]:
        return None
    head, rest = page.split(BEGIN, 1)
    block, tail = rest.split(END, 1)
    return head + BEGIN, block, END + tail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--check", metavar="PAGE", help="exit 1 if the page's reference block differs from the code")
    action.add_argument("--write", metavar="PAGE", help="replace the page's reference block with the current one")
    args = parser.parse_args(argv)
    text = render()
    page_path = args.check or args.write
    if page_path is None:
        print(text, end="")
        return 0
    parts = _split(Path(page_path).read_text())
    if parts is None:
        print(f"{page_path}: no {BEGIN} ... {END} block", file=sys.stderr)
        return 1
    head, block, tail = parts
    if args.write:
        Path(page_path).write_text(f"{head}\n{text}{tail}")
        return 0
    if block.strip("\n") + "\n" != text:
        print(f"{page_path}: the config reference is stale; regenerate with bash tools/update_config_reference.sh",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
