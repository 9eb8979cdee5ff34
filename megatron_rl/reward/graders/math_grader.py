"""Is a final answer equal to the ground truth? Competition-math answer forms, via math-verify.

Both sides are parsed whole: the answer text is put in one ``\\boxed{}`` and parsed by
``math_verify.parse`` with LaTeX + expression extraction (the LaTeX config matching the box
first, ``extraction_mode='first_match'``), then compared with ``math_verify.verify``. Parsing
the whole box matters: the old grader parsed answers without a backslash "raw", where
math-verify's expression extractor picks one number out of the text, so the gold ``6 - 5i``
read as 5, ``6r^2-4r-24`` as 6 and ``y = -2x`` as -2, and those truncated answers scored 1.

math-verify options (:class:`VerifyOptions`): floats equal when they agree to 6 decimals
(``0.333333`` is 1/3, ``0.333`` is not); ``strict=True``, so variables matter (``6x^2-4x-24``
is not ``6r^2-4r-24``); an inequality answers an interval or set gold when both are the same
set (``2 \\le x < 5`` for ``[2,5)``; math-verify's default only allows the reverse; the price:
``1 < x < 2`` also answers a gold pair ``(1,2)``, which math-verify reads as an open interval).
Its own signal-based timeouts are off: the caller bounds the whole call (see ``math_reward``).

Decisions on ambiguous forms (each is a row family in ``tests/data/math_grader_set.jsonl``):

* **Commas.** A comma followed by exactly three digits is a thousands separator (``1,080`` =
  1080, as math-verify reads it; GSM8K writes ``#### 1,080``); any other comma separates a list:
  ``-2,1`` is the pair -2 and 1, never the decimal -2.1 (competition answers use decimal
  points). Lists of answers compare as sets (``1,-2`` = ``-2, 1`` = ``\\{1,-2\\}``); an
  ordered pair ``(3,-1)`` keeps its order. ``(1,2)`` is math-verify's open interval, equal to
  the pair ``1, 2``.
* **Spaces inside numbers.** ``1\\,080`` / ``1 080`` (digit groups of three) are thousands
  separators; ``1 1/2`` is the mixed number 3/2 (like ``1\\frac12``). Any other two numbers
  side by side (``2 3``) are not graded: latex2sympy sums them (``2 3`` = 5).
* **Equations.** ``x = 5`` and a bare ``5`` answer each other (math-verify compares the
  right-hand side of an assignment): the value is what is asked. ``y = -2x`` needs the whole
  right side: ``-2`` is wrong, ``-2x`` or ``2x + y = 0`` right. An equation whose left side is
  not a bare symbol does not answer a plain value (``2x = 10`` is not 10, ``-x = 5`` not 5).
* **Bases.** ``52_8`` is the numeral 52 in base 8 (latex2sympy drops the subscript, so this is
  checked here): a base-b gold needs the same base-b digits (``52_{8}``; not ``52``, not the
  decimal ``42``); a base-b answer to a plain gold is compared by value; a numeral that cannot
  exist (``59_8``) is wrong.
* **Percent.** ``50\\%`` is 0.5 (math-verify), and a percent sign may also just be dropped:
  ``12.5\\%`` answers ``12.5`` and the other way round ("what percent" golds are written both
  ways). So ``0.5\\%`` also answers a gold ``0.5``: accepted as the price of the former.
* **Units and text.** math-verify drops units (``5\\text{ cm}`` = 5, so a wrong unit is not
  caught); plain words after a number (``18 dollars``, GSM8K style) are dropped too, unless a
  word changes the value (``5 squared``, ``2 hundred``, ``3 halves``). Words *before* the
  number are not dropped: ``#### The answer is 42`` is wrong, like an unboxed answer.
* **Multiple choice.** A gold that is one letter A-J (``B``, ``(B)``, ``\\text{(B)}``) is
  answered by that letter, alone or as the marker of an option (``(B) 12``, ``B) 12``); an
  answer naming a second letter (``(B) or (C)``) is wrong.
* **The imaginary unit.** A lone ``i`` is sqrt(-1) on both sides (math-verify keeps it a plain
  symbol, and gives it different sympy assumptions on the two sides depending on spacing), so
  ``6 - 5 i`` = ``6-5i`` and ``(1+i)^2`` = ``2i``; ``\\mathrm{i}`` is read as ``i`` (math-verify
  would strip it as a unit).

Known misses (right answers graded wrong, kept so): radians for a degree gold, an answer wholly
inside ``\\text{}`` with a unit (``\\text{10 ways}``), and unevaluated logarithms (``\\log_2 8``
for 3); competition answers are expected simplified.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

_TEXT_WRAPPER_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_DOLLARS_RE = re.compile(r"\\?\$")

# Imaginary unit spellings that math-verify would drop as a trailing unit.
_IMAGINARY_RE = re.compile(r"\\(?:mathrm|text|textit|mathit|operatorname)\s*\{\s*i\s*\}|\\imath\b")

# Digit groups split by spaces or thin spaces: 1\,080 or 1 000 000 (not part of a longer number).
_SPACE = r"(?:\s|\\[,;: ]|~)+"
_SPACED_THOUSANDS_RE = re.compile(rf"(?<![\d.])\d{{1,3}}(?:{_SPACE}\d{{3}})+(?![\d])")
_MIXED_NUMBER_RE = re.compile(rf"(?<![\d.])(\d+){_SPACE}(\d+)\s*/\s*(\d+)(?![\d.])")
_JUXTAPOSED_NUMBERS_RE = re.compile(rf"\d{_SPACE}\d")

# Base-b numeral: digits, an underscore and the base (52_8, 52_{8}, A3_{16}).
_BASE_RE = re.compile(r"^([0-9A-Za-z]+)_(?:\{\s*(\d+)\s*\}|(\d))$")

_PERCENT_SUFFIX_RE = re.compile(r"\s*(?:\\%|%|\\text\{\s*(?:\\%|%|percent)\s*\}|\bpercent)\s*$")

# A number followed by plain words: 18 dollars, 5 red apples.
_NUMBER_WORDS_RE = re.compile(r"^((?:\\?\$)?\s*[-+]?\d[\d,]*(?:\.\d+)?)\s+([A-Za-z]{3,}(?:\s+[A-Za-z]{3,}){0,2})\.?$")
_VALUE_WORDS = frozenset("""
    and or not than less more plus minus times over divided squared cubed root roots power
    hundred hundreds thousand thousands million millions billion billions trillion dozen dozens
    half halves third thirds quarter quarters fourth fourths fifth fifths sixth sixths tenth tenths
    hundredth hundredths thousandth thousandths percent sqrt sin cos tan cot sec csc log exp
    infinity pi
""".split())

# Multiple-choice letters.
_CHOICE_GOLD_RE = re.compile(r"^\(?([A-J])\)?$")
_CHOICE_PRED_RE = re.compile(r"^(?:\(([A-Ja-j])\)|([A-Ja-j])(?:[.):]|$))(.*)$", re.DOTALL)
_OTHER_CHOICE_RE = re.compile(r"(?<![A-Za-z\\])[A-J](?![A-Za-z])")


@dataclass(frozen=True)
class VerifyOptions:
    """The ``math_verify.verify`` options the grader uses: math-verify's defaults, stated here
    on purpose, except ``allow_set_relation_comp``."""

    float_rounding: int = 6
    """Decimal places floats are rounded to before comparing: 0.333333 is 1/3, 0.333 is not."""
    numeric_precision: int = 15
    """Significant digits of the numeric (evalf) comparison of expressions."""
    strict: bool = True
    """Variables must match by name (x+1 is not y+1)."""
    allow_set_relation_comp: bool = True
    """Whether an inequality answers a set gold when both describe the same set (2 <= x < 5 for
    [2,5)); math-verify's default (off) only lets a set answer a relation gold."""


DEFAULT_OPTIONS = VerifyOptions()


def _extraction_configs() -> list:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


def _normalize(text: str) -> str:
    """Rewrite the forms latex2sympy misreads (see the module docstring), both sides alike."""
    text = _IMAGINARY_RE.sub(" i ", text)
    text = text.replace("\\varnothing", "\\emptyset")   # latex2sympy knows only \emptyset
    text = _SPACED_THOUSANDS_RE.sub(lambda m: re.sub(_SPACE, "", m.group()), text)
    return _MIXED_NUMBER_RE.sub(r"\1\\frac{\2}{\3}", text)


def _parse(text: str) -> tuple:
    """math-verify's parse of ``text`` as one boxed answer; () when nothing parses."""
    from math_verify import parse

    # No timeout here: the caller bounds the whole grading call (signal.alarm in here could
    # not interrupt a long C-level big-integer operation anyway).
    parsed = parse("\\boxed{" + text + "}", extraction_config=_extraction_configs(),
                   extraction_mode="first_match", parsing_timeout=None)
    return tuple(_with_imaginary_unit(p) for p in parsed)


@lru_cache(maxsize=256)
def parse_gold(gold: str) -> tuple:
    """Parsed ground truth (cached: a GRPO group grades many responses against one gold).

    Raises ValueError when math-verify cannot read it at all, or it has two numbers side by
    side ('2 3', which latex2sympy would read as 5).
    """
    normalized = _normalize(gold)
    if _JUXTAPOSED_NUMBERS_RE.search(normalized):
        raise ValueError(f"ground truth {gold!r} has two numbers side by side (latex2sympy would add them)")
    parsed = _parse(normalized)
    if not parsed:
        raise ValueError(f"math-verify cannot parse the ground truth {gold!r}")
    return parsed


def _with_imaginary_unit(expr):
    """``expr`` with every symbol named 'i' replaced by sympy's I and the other symbols made
    real, so both sides agree whatever assumptions math-verify's complex heuristic gave them."""
    import sympy
    from latex2sympy2_extended.sets import FiniteSet

    if not isinstance(expr, (sympy.Basic, sympy.MatrixBase)):
        return expr
    symbols = getattr(expr, "free_symbols", set())
    if not any(s.name == "i" for s in symbols):
        return expr
    mapping = {s: (sympy.I if s.name == "i" else sympy.Symbol(s.name, real=True)) for s in symbols}
    if isinstance(expr, FiniteSet) and hasattr(expr, "_unsorted_args"):
        # Keep the written order: math-verify compares a listed answer to an ordered gold by it.
        return FiniteSet(*[_with_imaginary_unit_in(a, mapping) for a in expr._unsorted_args])
    return _with_imaginary_unit_in(expr, mapping)


def _with_imaginary_unit_in(expr, mapping: dict):
    try:
        return expr.xreplace(mapping)
    except Exception:  # noqa: BLE001 - an object sympy cannot rebuild is compared as parsed
        return expr


def _unwrap(text: str) -> str:
    """``text`` without ``\\text{}``-style wrappers and dollar signs (for the pattern rules)."""
    previous = None
    while previous != text:
        previous, text = text, _TEXT_WRAPPER_RE.sub(r"\1", text)
    return _DOLLARS_RE.sub("", text).strip()


_INVALID_NUMERAL = ("", 0)


def _base_numeral(text: str) -> tuple[str, int] | None:
    """(digits, base) of a base-b numeral such as ``52_8``; ``_INVALID_NUMERAL`` for one that
    cannot be (``59_8``, ``163_{00}``: latex2sympy would read them as 59 and 163); None when
    ``text`` is no subscripted number (``x_1`` is a symbol)."""
    match = _BASE_RE.match(_unwrap(text))
    if match is None or not any(c.isdigit() for c in match.group(1)):
        return None
    digits, base = match.group(1), int(match.group(2) or match.group(3))
    if not 2 <= base <= 36:
        return _INVALID_NUMERAL
    try:
        int(digits, base)
    except ValueError:
        return _INVALID_NUMERAL
    return digits.upper().lstrip("0") or "0", base


def _choice(text: str, gold: bool) -> str | None:
    """The multiple-choice letter of a gold (the whole answer) or of an answer (its marker)."""
    text = _unwrap(text)
    if gold:
        match = _CHOICE_GOLD_RE.match(text)
        return match.group(1) if match else None
    match = _CHOICE_PRED_RE.match(text)
    if match is None or _OTHER_CHOICE_RE.search(match.group(3)):
        return None
    return (match.group(1) or match.group(2)).upper()


def _has_equation(expr) -> bool:
    from math_verify.grader import is_equation
    from sympy import FiniteSet, Tuple

    if isinstance(expr, (FiniteSet, Tuple)):
        return any(_has_equation(e) for e in expr.args)
    return not isinstance(expr, str) and is_equation(expr)


def _is_assignment(expr) -> bool:
    """Not an equation, or one naming what it gives: x = 5, xy = 6, f(2) = 5 (a set: each)."""
    from math_verify.grader import (
        is_assignment_relation,
        is_equation,
        take_first_relation,
    )
    from sympy import FiniteSet, Tuple
    from sympy.core.function import AppliedUndef

    if isinstance(expr, (FiniteSet, Tuple)):
        return all(_is_assignment(e) for e in expr.args if _has_equation(e))
    if not is_equation(expr) or is_assignment_relation(expr):
        return True
    return isinstance(take_first_relation(expr).lhs, AppliedUndef)


def _verify(gold: tuple, pred: tuple, options: VerifyOptions) -> bool:
    from math_verify import verify

    if not any(_has_equation(g) for g in gold):
        # math-verify answers a gold that is no equation with an equation's right side alone,
        # meant for 'x = 2 + 3 = 5'; so -x = 5 or 2x = 10 would answer 5 or 10. Only
        # assignments (a symbol on the left) keep that reading.
        pred = tuple(p for p in pred if _is_assignment(p))
    return bool(pred) and bool(verify(
        list(gold), list(pred), float_rounding=options.float_rounding,
        numeric_precision=options.numeric_precision, strict=options.strict,
        allow_set_relation_comp=options.allow_set_relation_comp, timeout_seconds=None))


def answers_match(gold: str, answer: str, options: VerifyOptions = DEFAULT_OPTIONS) -> bool:
    """Whether ``answer`` (a response's extracted final answer) equals ``gold`` (the extracted
    ground truth). Raises ValueError when the gold cannot be parsed; never for the answer."""
    gold, answer = gold.strip(), answer.strip()
    gold_base, answer_base = _base_numeral(gold), _base_numeral(answer)
    if gold_base == _INVALID_NUMERAL:
        raise ValueError(f"ground truth {gold!r} is not a valid base-b numeral")
    if answer_base == _INVALID_NUMERAL:
        return False
    if gold_base is not None:
        if gold_base[1] == 10 and answer_base is None:
            return answers_match(gold_base[0], answer, options)
        return answer_base == gold_base
    if answer_base is not None:
        # A numeral in base b answering a plain gold: compare its value.
        return _verify(parse_gold(gold), _parse(str(int(*answer_base))), options)

    gold_choice = _choice(gold, gold=True)
    if gold_choice is not None:
        answer_choice = _choice(answer, gold=False)
        if answer_choice is not None:
            return answer_choice == gold_choice

    gold_parsed = parse_gold(gold)
    normalized = _normalize(answer)
    if _JUXTAPOSED_NUMBERS_RE.search(normalized):
        return False             # '2 3': not a number latex2sympy reads as written
    if _verify(gold_parsed, _parse(normalized), options):
        return True
    return any(_verify(g, _parse(a), options) for g, a in _alternatives(gold, normalized))


def _alternatives(gold: str, answer: str) -> list[tuple[tuple, str]]:
    """(parsed gold, answer text) pairs of the fallback readings (module docstring)."""
    out = []
    words = _NUMBER_WORDS_RE.match(answer)
    if words and not any(w.lower() in _VALUE_WORDS for w in words.group(2).split()):
        out.append((parse_gold(gold), words.group(1)))          # 18 dollars -> 18
    gold_pct, answer_pct = _PERCENT_SUFFIX_RE.search(gold), _PERCENT_SUFFIX_RE.search(answer)
    if (gold_pct is None) != (answer_pct is None):
        # Exactly one side has a percent sign: also compare the bare numbers.
        bare_answer = _PERCENT_SUFFIX_RE.sub("", answer) if answer_pct else answer
        try:
            bare_gold = parse_gold(_PERCENT_SUFFIX_RE.sub("", gold) if gold_pct else gold)
        except ValueError:
            return out           # nothing left of the gold without its percent sign
        out.append((bare_gold, bare_answer))
    return out
