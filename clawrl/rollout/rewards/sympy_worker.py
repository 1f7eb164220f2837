"""The sympy worker process behind `sympy_judge`: one JSON request per stdin line, one JSON reply per line.

Request `{"a": str, "b": str, "timeout_s": float}` (sympy source text already restricted by
`sympy_judge.to_sympy_source`); reply `{"equal": true | false | null}` (null: ran past `timeout_s`). The first
line written is "ready", after sympy is imported. It imports nothing from clawrl, so it starts by file path:
    echo '{"a": "x+1", "b": "1+x", "timeout_s": 5}' | python clawrl/rollout/rewards/sympy_worker.py
"""

from __future__ import annotations

import json
import signal
import sys

FUNCTIONS = ("sqrt", "sin", "cos", "tan", "cot", "sec", "csc", "log", "exp", "pi", "oo")
"""The only multi-letter names an expression may contain (functions and constants of sympy)."""


class _Overrun(BaseException):
    """Raised by SIGALRM; a BaseException so that sympy's own `except Exception` blocks cannot swallow it."""


def _on_alarm(signum, frame):
    raise _Overrun


def _evaluate(a: str, b: str) -> bool:
    import sympy
    from sympy.parsing.sympy_parser import (
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    names = {name: getattr(sympy, name) for name in ("Integer", "Float", "Rational", "Symbol", *FUNCTIONS)}
    names["__builtins__"] = {}
    symbols = {c: sympy.Symbol(c) for c in "abcdfghjklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"}
    symbols.update(e=sympy.E, i=sympy.I)  # answers write Euler's number and the imaginary unit as e and i
    transformations = standard_transformations + (implicit_multiplication_application,)
    expr_a = parse_expr(a, local_dict=dict(symbols), global_dict=dict(names), transformations=transformations)
    expr_b = parse_expr(b, local_dict=dict(symbols), global_dict=dict(names), transformations=transformations)
    return bool(sympy.simplify(expr_a - expr_b) == 0)


def serve() -> None:
    """Answer requests until stdin closes (the parent exited or stopped this worker)."""
    import sympy  # noqa: F401  (imported before "ready" so that start-up time is not charged to a request)

    signal.signal(signal.SIGALRM, _on_alarm)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        signal.setitimer(signal.ITIMER_REAL, float(request["timeout_s"]))
        try:
            reply = {"equal": _evaluate(request["a"], request["b"])}
        except _Overrun:
            reply = {"equal": None}
        except Exception as e:  # a parse or sympy error means "not shown equal"
            reply = {"equal": False, "error": repr(e)[:200]}
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    serve()
