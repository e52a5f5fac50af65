"""Final-answer extraction and equivalence checking for math environments.

The answer is the content of the last `\\boxed{...}` (nested braces allowed), else the last
number in the text. Equivalence: exact numeric comparison with `fractions.Fraction` when both
sides are plain numbers (fast path, also "0.5" == "1/2"), else sympy on a whitelisted,
size-limited expression. Model output is untrusted: sympy parses with `eval`, so only strings
made of digits, operators, parentheses and a few known names ever reach it, and huge powers are
refused before anything is evaluated.
"""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_SAFE_EXPR = re.compile(r"^[0-9a-z+\-*/^().\s]*$")
_ALLOWED_NAMES = {"sqrt", "pi", "e", "i", "x", "y", "n"}
MAX_EXPR_CHARS = 120
MAX_EXPONENT = 64


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` or `\\fbox{...}`, braces balanced; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The model's final answer: last boxed content, else last number, else None."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _strip_latex(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = re.sub(r"\\text\{[^{}]*\}", "", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/")
    s = s.replace("\\pi", "pi").replace("\\%", "").replace("%", "")
    for _ in range(4):
        s = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
        s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = s.replace("{", "(").replace("}", ")")
    # Thousands separators: "1,234" -> "1234" (a comma list is not a single answer anyway).
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)
    return s.strip().rstrip(".").strip()


def _as_fraction(s: str) -> Fraction | None:
    try:
        return Fraction(s.replace(" ", ""))
    except (ValueError, ZeroDivisionError):
        return None


def _sympy_value(s: str):  # returns a sympy expression or None
    if len(s) > MAX_EXPR_CHARS or not _SAFE_EXPR.match(s):
        return None
    # One power at most: towers like 9^9^9 are refused before sympy sees them.
    if s.count("^") + s.count("**") > 1:
        return None
    names = set(re.findall(r"[a-z]+", s))
    if not names <= _ALLOWED_NAMES:
        return None
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    transformations = (*standard_transformations, convert_xor, implicit_multiplication_application)
    local = {name: sympy.Symbol(name) for name in ("x", "y", "n")}
    local.update({"pi": sympy.pi, "e": sympy.E, "i": sympy.I, "sqrt": sympy.sqrt})
    try:
        expr = parse_expr(s, local_dict=local, transformations=transformations, evaluate=False)
    except Exception:
        return None
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Pow) and node.exp.is_number:
            try:
                if abs(float(node.exp)) > MAX_EXPONENT:
                    return None
            except (TypeError, ValueError):
                return None
    return expr


def answers_match(given: str | None, truth: str | float) -> bool:
    """True when `given` is mathematically equal to `truth`."""
    if given is None:
        return False
    a, b = _strip_latex(str(given)), _strip_latex(str(truth))
    if not a or not b:
        return False
    if a == b:
        return True
    fa, fb = _as_fraction(a), _as_fraction(b)
    if fa is not None and fb is not None:
        return fa == fb
    ea, eb = _sympy_value(a), _sympy_value(b)
    if ea is None or eb is None:
        return False
    import sympy

    try:
        diff = sympy.simplify(ea - eb)
        return bool(diff == 0)
    except Exception:
        return False


def has_format(text: str) -> bool:
    """The answer is given in the requested `\\boxed{}` form."""
    return last_boxed(text) is not None
