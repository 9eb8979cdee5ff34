"""A flame graph SVG from collapsed stacks (stack -> seconds), the picture Brendan Gregg's
flamegraph.pl draws: one box per frame, as wide as the time spent in it and below it, callers
under callees; hover a box for its name, seconds and share. Self-contained SVG (no scripts)."""
from __future__ import annotations

import hashlib
from html import escape

ROW = 16
WIDTH = 1200
MIN_PX = 0.5  # narrower boxes are dropped (they are invisible anyway)


def _colour(name: str) -> str:
    # Warm colours, stable per function name, as flame graphs usually are.
    h = int(hashlib.md5(name.encode()).hexdigest()[:6], 16)
    return f"rgb({205 + h % 50},{(h >> 8) % 180 + 40},{(h >> 16) % 55})"


def _tree(stacks: dict[tuple[str, ...], float]) -> dict:
    root: dict = {"name": "all", "value": 0.0, "children": {}}
    for stack, seconds in stacks.items():
        node = root
        root["value"] += seconds
        for frame in stack:
            node = node["children"].setdefault(frame, {"name": frame, "value": 0.0, "children": {}})
            node["value"] += seconds
    return root


def _depth(node: dict) -> int:
    return 1 + max((_depth(c) for c in node["children"].values()), default=0)


def flame_svg(stacks: dict[tuple[str, ...], float], title: str) -> str:
    """The SVG text of a flame graph over ``stacks`` (outermost frame first in each stack)."""
    root = _tree(stacks)
    total = root["value"] or 1.0
    height = (_depth(root) + 2) * ROW + 10
    scale = WIDTH / total
    boxes: list[str] = []

    def draw(node: dict, x: float, level: int) -> None:
        width = node["value"] * scale
        if width < MIN_PX:
            return
        y = height - (level + 1) * ROW
        label = escape(node["name"])
        tip = f"{label}: {node['value']:.2f} s ({100 * node['value'] / total:.1f} %)"
        text = label if width > 40 else ""
        chars = int(width / 6.5)
        if text and len(text) > chars:
            text = text[:max(chars - 2, 0)] + ".."
        boxes.append(f'<g><title>{tip}</title><rect x="{x:.1f}" y="{y}" width="{width:.1f}" height="{ROW - 1}" '
                     f'fill="{_colour(node["name"])}" rx="2"/>'
                     + (f'<text x="{x + 3:.1f}" y="{y + ROW - 4}">{text}</text>' if text else "") + "</g>")
        child_x = x
        for child in sorted(node["children"].values(), key=lambda c: c["name"]):
            draw(child, child_x, level + 1)
            child_x += child["value"] * scale

    draw(root, 0.0, 0)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'font-family="monospace" font-size="11">'
            f'<rect width="100%" height="100%" fill="#fdfdf5"/>'
            f'<text x="6" y="14" font-size="13">{escape(title)} ({total:.2f} s of samples)</text>'
            + "".join(boxes) + "</svg>")
