"""Final-answer extraction for the math reward, linear-time on any input.

A response's answer is the content of its last complete ``\\boxed{...}`` (or ``\\fbox{...}``) or
the text after its last ``####``, whichever starts later. Both scans are single passes over the
text (a regex tokenizer plus a brace stack), so 100 KB of unclosed ``\\boxed{`` or of nested
braces costs milliseconds: the parent process runs them too (on a timeout it reports what the
response answered), so they must stay cheap for every input the grader child could choke on.

Brace matching follows LaTeX: ``\\{`` and ``\\}`` are literal braces (set notation), not
grouping, and ``\\\\`` is a line break (so ``\\\\boxed`` is not a box command).
"""
from __future__ import annotations

import re

# One token per match: a box opener, an escaped character (\{ \} \\ ...), or a grouping brace.
# Alternation order matters: the opener is tried before the generic escape.
_BOX_TOKEN_RE = re.compile(r"(?P<box>\\(?:boxed|fbox)[ \t\n]*\{)|\\[^A-Za-z]|[{}]")
_HASH_RE = re.compile(r"####[ \t]*([^\n]*)")


def last_boxed(text: str) -> tuple[int, str] | None:
    """(position, content) of the last complete ``\\boxed{...}`` / ``\\fbox{...}``, else None.

    "Last" is the box that starts last among those whose braces close; an unclosed one (a
    response cut off mid-answer) is skipped, so ``\\boxed{5} ... \\boxed{\\frac{1`` gives '5'.
    In ``\\boxed{\\boxed{5}}`` the inner box starts last. Content is stripped of whitespace.
    """
    # Per open brace: (box start, content start) when it opens a box, else None.
    stack: list[tuple[int, int] | None] = []
    best: tuple[int, int, int] | None = None   # (box start, content start, content end)
    for match in _BOX_TOKEN_RE.finditer(text):
        token = match.group()
        if token == "{":
            stack.append(None)
        elif token == "}":
            if not stack:
                continue           # a stray closing brace outside any group
            box = stack.pop()
            if box is not None and (best is None or box[0] > best[0]):
                best = (box[0], box[1], match.start())
        elif match.lastgroup == "box":
            stack.append((match.start(), match.end()))
        # else an escaped character: literal, no effect on grouping
    if best is None:
        return None
    _, begin, end = best
    return best[0], text[begin:end].strip()


def last_hash_answer(text: str) -> tuple[int, str] | None:
    """(position, content) of the last ``#### X`` line; trailing '.' and whitespace dropped.

    None when there is no ``####`` or the last one has nothing after it on its line.
    """
    last = None
    for last in _HASH_RE.finditer(text):
        pass
    if last is None:
        return None
    answer = last.group(1).strip().rstrip(".").strip()
    return (last.start(), answer) if answer else None


def extract_response_answer(response: str) -> str | None:
    """The final answer of a response: from whichever of its last complete ``\\boxed{}`` and its
    last ``####`` line starts later; None when it has neither (or the chosen box is empty)."""
    candidates = [c for c in (last_boxed(response), last_hash_answer(response)) if c is not None]
    if not candidates:
        return None
    answer = max(candidates)[1]
    return answer or None


def extract_ground_truth(answer: str) -> str:
    """The comparable part of a dataset answer: after the last '####' (GSM8K), else the last
    ``\\boxed{}`` content (MATH solutions), else the whole string (stripped)."""
    hashed = last_hash_answer(answer)
    if hashed is not None:
        return hashed[1]
    boxed = last_boxed(answer)
    if boxed is not None:
        return boxed[1]
    return answer.strip()
