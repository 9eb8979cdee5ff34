"""Import cycles in a module graph ({module: modules it imports}), for the layering tests."""
from __future__ import annotations

from collections import deque


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Every group of modules that import each other, directly or not (Tarjan's algorithm,
    iterative: no recursion limit on a deep graph). Groups of one are left out unless the module
    imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1 or node in graph.get(node, ()):
                    groups.append(group)
    return groups


def one_cycle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest import chain that leaves the group's first module and comes back to it."""
    start = min(group)
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph.get(node, ())):
            if child == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(previous[chain[-1]])
                return [start, *reversed(chain[:-1]), start]
            if child in group and child not in previous:
                previous[child] = node
                queue.append(child)
    raise ValueError(f"{sorted(group)} is not a cycle of the graph")


def describe_cycles(graph: dict[str, set[str]]) -> list[str]:
    """One line per cycle group: 'a -> b -> a' (empty when the graph has none)."""
    return [" -> ".join(one_cycle(graph, group)) for group in strongly_connected(graph)]
