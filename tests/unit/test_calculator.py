"""The calculator tool (issues 53, 62): arithmetic like Python's where it is real and small,
a one-line CalculatorError for everything else — never another exception, never a complex
number — refused from the sizes before computing."""

import math
import random
import time
from pathlib import Path

import pytest

from megatron_p3o.data.tasks import tool_calc
from megatron_p3o.env.calculator import CalculatorError, calculate
from megatron_p3o.env.types import EnvItem, StepResult


def test_the_calculator_computes_arithmetic_like_python():
    rng = random.Random(0)
    for _ in range(300):
        a, b, c = (rng.randint(-99, 99) for _ in range(3))
        op1, op2 = rng.choice("+-*"), rng.choice(["+", "-", "*", "//", "%"])
        if op2 in ("//", "%") and c == 0:
            c = 7
        expr = f"({a}{op1}{b}){op2}{c}"
        assert calculate(expr) == eval(expr)  # noqa: S307 - the reference, on our own input
    assert calculate("7/2") == 3.5 and calculate("8/2") == 4 and calculate("2**10") == 1024


@pytest.mark.parametrize(
    "expr,msg",
    [
        ("9**9**9", "exponent"),
        ("10**60*10**60", "digits"),
        ("2**64**2", "exponent"),
        ("999999999999**9", "digits"),
        ("1/0", "division by zero"),
        ("__import__('os').system('x')", "not arithmetic"),
        ("open('f')", "not arithmetic"),
        ("1_000", "'_'"),
        ("(" * 150 + "1" + ")" * 150, "longer than"),
        ("", "empty"),
    ],
)
def test_the_calculator_refuses_before_computing(expr, msg):
    """Refused from the sizes, not after the work: 9**9**9 would take minutes (a bound of a
    second, not a timing)."""
    t0 = time.monotonic()
    with pytest.raises(CalculatorError) as e:
        calculate(expr)
    assert time.monotonic() - t0 < 1.0 and msg in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "expr,want",
    [
        ("(1e-200)**-64", "digits"),  # OverflowError in Python
        ("2**((-1)**0.5)", "not a real number"),  # TypeError (complex) in Python
        ("0**((-1)**0.5)", "not a real number"),
        ("(-1)**0.5//1", "not a real number"),
        ("(-8)**(1/3)", "not a real number"),  # Python: a complex number
        ("1e-300**2", "too small"),
        ("1e308*10", "digits"),
        ("10**51", 10**51),  # 52 digits: within the bound
        ("99999999999**9", 99999999999**9),  # 99 digits
        ("(-2)**2.0", 4.0),
        ("2**-3", 0.125),
    ],
)
def test_the_calculator_raises_only_its_own_error_and_returns_real_numbers(expr, want):
    """Issue 62's table: every input either gives a real number (Python's value) or a
    CalculatorError naming why — never another exception, never a complex number."""
    if isinstance(want, str):
        with pytest.raises(CalculatorError) as e:
            calculate(expr)
        assert want in str(e.value)
        return
    got = calculate(expr)
    assert type(got) in (int, float) and got == want


def test_the_calculator_env_calls_the_tool_then_scores_the_answer():
    from megatron_p3o.env.calc_env import CalculatorEnv

    env = CalculatorEnv(max_tool_calls=1)
    assert env.reset(EnvItem(0, "37*48+15", "1791", 0)) is None
    r = env.step("<calc>37*48+15</calc>")
    assert (r.observation, r.tool_calls, r.done) == ("1791", 1, False)
    r = env.step("<calc>9**9**9</calc>")  # over the call limit
    assert r.done and r.tool_error and "more than 1" in r.observation
    env.reset(EnvItem(0, "37*48+15", "1791", 0))
    assert env.step("1791") == StepResult(reward=1.0, done=True)
    env.reset(EnvItem(0, "37*48+15", "1791", 0))
    assert env.step("1790").reward == 0.0
    bad = CalculatorEnv().step("<calc>1/0</calc>")
    assert bad.tool_error and bad.observation == "error: division by zero" and not bad.done


def test_tool_calc_splits_never_share_an_expression():
    train, held = tool_calc.splits(3000, 300)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    for r in held[:50]:
        a, rest = r["prompt"].split("*")
        b, c = rest.split("+")
        assert int(r["answer"]) == int(a) * int(b) + int(c)
    assert math.isclose(sum(len(r["answer"]) for r in held) / len(held), 3.9, abs_tol=0.3)
    assert Path(tool_calc.__file__).read_text().count("eval(") == 0
