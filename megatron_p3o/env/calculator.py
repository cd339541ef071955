"""A calculator tool: arithmetic parsed and evaluated here, never ``eval``.

Why its own evaluator: a tool runs on whatever the policy writes. ``eval`` runs code, and even
a pure arithmetic evaluator that computes ``9**9**9`` hangs a rollout worker for minutes (the
result has 3.7e8 digits). Here every operation is checked for size *before* it is computed:
integers stay below ``10**MAX_DIGITS``, exponents below ``MAX_EXPONENT``, the expression below
``MAX_CHARS`` characters and ``MAX_NODES`` syntax nodes; anything else is a
:class:`CalculatorError` with a one-line reason, which the environment turns into an error
observation.

Grammar: integers and decimals, ``+ - * / // % **``, unary ``+ -``, parentheses. Division of
integers that divide exactly stays an integer; other results are floats (``repr`` rounding is
the tool's output; the task's answers are integers). Results are real numbers only: a negative
base to a fractional power is refused (Python would return a complex number), and so is anything
Python itself refuses (overflow, a division by zero): the tool raises :class:`CalculatorError`
and nothing else.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Union

MAX_CHARS = 200
MAX_NODES = 100
MAX_DIGITS = 100
MAX_EXPONENT = 64

Number = Union[int, float]


class CalculatorError(ValueError):
    """The expression is not arithmetic this tool computes; the message says why."""


_BIN = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _log10(x: Number) -> float:
    """log10 |x| (−inf for 0); exact enough for the size checks (big integers included)."""
    return math.log10(abs(x)) if x else -math.inf


def _too_big(log10_value: float) -> bool:
    """A value of magnitude 10**log10_value has more than MAX_DIGITS integer digits: a number
    of d digits lies in [10**(d−1), 10**d)."""
    return log10_value >= MAX_DIGITS


def _check(x: Number) -> Number:
    if not isinstance(x, (int, float)):
        raise CalculatorError("the result is not a real number")
    if isinstance(x, float) and not math.isfinite(x):
        raise CalculatorError("the result is not a finite number")
    if _too_big(_log10(x)):
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    return x


def _power(a: Number, b: Number) -> Number:
    if abs(b) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {b} is larger than {MAX_EXPONENT}")
    if a == 0 and b < 0:
        raise CalculatorError("division by zero")
    if a < 0 and not float(b).is_integer():
        raise CalculatorError("a negative number to a fractional power is not a real number")
    if a != 0 and _too_big(b * _log10(a)):
        raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
    if isinstance(a, float) and a != 0 and b * _log10(a) < -300:  # underflows to 0: say so
        raise CalculatorError("the result is too small to represent")
    return a**b


def _divide(op, a: Number, b: Number) -> Number:
    if b == 0:
        raise CalculatorError("division by zero")
    if op is operator.truediv and isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b
    return op(a, b)


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        a, b = _eval(node.left), _eval(node.right)
        op = _BIN[type(node.op)]
        if op is operator.pow:
            return _check(_power(a, b))
        if op in (operator.truediv, operator.floordiv, operator.mod):
            return _check(_divide(op, a, b))
        if op is operator.mul and a and b and _too_big(_log10(a) + _log10(b)):
            raise CalculatorError(f"the result has more than {MAX_DIGITS} digits")
        return _check(op(a, b))
    raise CalculatorError(f"{type(node).__name__} is not arithmetic")


def calculate(expression: str) -> Number:
    """The value of ``expression``; :class:`CalculatorError` for anything else."""
    text = expression.strip()
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    if "_" in text:  # Python accepts 1_000; a calculator should not guess
        raise CalculatorError("'_' is not arithmetic")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {text!r}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"expression has more than {MAX_NODES} parts")
    try:
        return _eval(tree)
    except CalculatorError:
        raise
    except (ArithmeticError, TypeError, ValueError) as e:  # what Python refuses, in one line
        raise CalculatorError(f"cannot compute {text!r}: {type(e).__name__}") from None


def format_number(x: Number) -> str:
    """The tool's output text: integers as they are, floats with up to 12 significant digits
    (an integral float without its ``.0``)."""
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return str(x) if isinstance(x, int) else f"{x:.12g}"
