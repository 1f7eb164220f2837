"""`--rm-type math`: boxed extraction, LaTeX normalisation, equivalence rules and the sympy deadline."""

import asyncio
import json
import time

import pytest

from clawrl.data.sample import Sample
from clawrl.rollout.rewards.latex import last_boxed_content
from clawrl.rollout.rewards.math_rm import math_reward, normalise_answer
from clawrl.rollout.rewards.sympy_judge import _Worker, sympy_equal, to_sympy_source


def _math(response, label, **kw):
    return asyncio.run(math_reward(Sample(response=response, label=label), **kw))


MATH_CASES = [
    # (response, label, reward)
    (r"so the answer is \boxed{\frac{1}{2}}.", "0.5", 1.0),
    (r"\boxed{\dfrac{1}{2}}", r"\frac12", 1.0),
    (r"\boxed{\tfrac{1}{2}}", "1/2", 1.0),
    (r"\boxed{0.5}", "1/2", 1.0),
    (r"\boxed{.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}", 1.0),  # nested braces + \sqrt shorthand
    (r"first \boxed{3}, no wait: \boxed{4}", "4", 1.0),  # last box wins
    (r"first \boxed{3}, no wait: \boxed{4}", "3", 0.0),
    ("the answer is 4", "4", 0.0),  # no box
    (r"\boxed{4}", "", 0.0),  # empty label
    (r"\boxed{4}", None, 0.0),
    (r"\boxed{1,000}", "1000", 1.0),
    (r"\boxed{1{,}000}", "1000", 1.0),
    (r"\boxed{-3.0}", "-3", 1.0),
    ("\\boxed{\u22123}", "-3", 1.0),  # unicode minus
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{10\text{ cm}}", "10", 1.0),
    (r"\boxed{12 \mbox{ inches}}", "12", 1.0),
    (r"\boxed{5 \text{ m}^2}", "5", 1.0),
    (r"\boxed{30^\circ}", "30", 1.0),
    (r"\boxed{30^{\circ}}", "30 degrees", 1.0),
    (r"\boxed{\text{Monday}}", "Monday", 1.0),
    (r"\boxed{\$5}", "5.00", 1.0),
    (r"$\boxed{7.}$", "7", 1.0),  # trailing period
    (r"\boxed{x = 5}", "5", 1.0),
    (r"\boxed{12}", r"\boxed{12}", 1.0),  # boxed label
    (r"\fbox{12}", "12", 1.0),
    (r"$\boxed 5$", "5", 1.0),
    (r"\boxed{\frac{6}{2}}", "3", 0.0),  # integer label needs an integer literal
    (r"\boxed{\frac{2}{4}}", r"\frac{1}{2}", 0.0),  # unreduced fraction
    (r"\boxed{-\frac{1}{2}}", r"\frac{-1}{2}", 1.0),
    (r"\boxed{3.5}", r"\frac{7}{2}", 1.0),
    (r"\boxed{0.333}", r"\frac{1}{3}", 0.0),
    (r"\boxed{5}", "6", 0.0),
    (r"\boxed{5", "5", 0.0),  # unbalanced brace: no answer
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
    (r"\boxed{(0.5, 2)}", r"(\frac12, 2)", 1.0),  # element-wise equivalence
    (r"\boxed{(2, 1)}", "(1, 2)", 0.0),  # order matters
    (r"\boxed{(1, 2]}", "(1, 2)", 0.0),  # open vs closed interval
    (r"\boxed{(1, 2, 3)}", "(1, 2)", 0.0),
    (r"\boxed{\left(3,\!4\right)}", "(3,4)", 1.0),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),  # sympy
    (r"\boxed{2x+2}", "2(x+1)", 1.0),  # sympy
    (r"\boxed{x^2}", "x^3", 0.0),  # sympy, different
    (r"\boxed{2\pi}", r"\pi \cdot 2", 1.0),  # sympy
    (r"\boxed{3+4i}", r"4i+3", 1.0),  # sympy with the imaginary unit
    (r"\boxed{42}", 42, 1.0),  # int label
    (r"\boxed{\frac{1}{2}}", 0.5, 1.0),  # float label
    ("\\boxed{" + "9" * 5000 + "}", "9" * 4999 + "8", 0.0),  # over int()'s digit limit: no crash
]


# What slime's `math` grader (Hendrycks string normalisation, then a case-insensitive normalisation with sympy)
# accepts or rejects; each line names the rule of slime's that decides it.
SLIME_MATH_CASES = [
    # (response, label, reward)
    (r"\boxed{monday}", "Monday", 1.0),  # text answers are not case sensitive
    (r"\boxed{\text{MONDAY}}", "monday", 1.0),
    (r"\boxed{\mathrm{Monday}}", "MONDAY", 1.0),
    (r"\boxed{\textbf{Yes}}", "yes", 1.0),
    (r"\boxed{B}", "b", 1.0),
    (r"\boxed{\text{(B)}}", "B", 1.0),  # "(b)" and "b" are equal under sympy
    (r"\boxed{X+1}", "x+1", 1.0),  # lower-cased before sympy too
    (r"\boxed{tuesday}", "Monday", 0.0),
    (r"\boxed{silent}", "listen", 0.0),  # more than two unknown letters: never given to sympy
    (r"\boxed{a+b+c}", "c+b+a", 0.0),  # the same rule
    (r"\boxed{10\text{ apples}}", "10", 1.0),  # a trailing "\text{ ..." names the unit
    (r"\boxed{12\text{ square feet}}", "12", 1.0),
    (r"\boxed{2 \text{ and } 3}", "2, 3", 1.0),  # " and " / " or " separate answers
    (r"\boxed{3 or 4}", "3,4", 1.0),
    (r"\boxed{2 and 3}", "2, 4", 0.0),
    (r"\boxed{2\text{and}3}", "2, 3", 0.0),  # only a spaced " and " separates
    (r"\boxed{7\frac{3}{4}}", r"\frac{31}{4}", 1.0),  # a mixed number is a sum
    (r"\boxed{7 3/4}", "7.75", 1.0),
    (r"\boxed{7\frac{3}{4}}", r"\frac{21}{4}", 0.0),  # ... not a product
    (r"\boxed{\{1, 2\}}", "1, 2", 1.0),  # braces are dropped
    (r"\boxed{\left\{1,2\right\}}", "1,2", 1.0),
    (r"\boxed{\dfrac{\pi}{2}}", r"\frac{\pi}{2}", 1.0),
    (r"\boxed{\frac{9}{4}\pi}", r"\frac{9\pi}{4}", 1.0),  # sympy
    (r"\boxed{x^{2}}", "x^2", 1.0),
    (r"\boxed{1.5}", r"\frac{3}{2}", 1.0),
    (r"\boxed{100}", "100.00", 1.0),
    (r"\boxed{5.0}", "5", 1.0),
    (r"\boxed{1,000,000}", "1000000", 1.0),
    (r"\boxed{3\times 10^5}", "300000", 0.0),  # an integer label needs an integer literal
    (r"\boxed{\sqrt{9}}", "3", 0.0),
    (r"\boxed{\sqrt{18}}", r"3\sqrt{2}", 1.0),
    (r"\boxed{50}", r"50\%", 1.0),
    (r"\boxed{10\%}", "0.1", 0.0),
    (r"\boxed{30\text{ degrees}}", "30", 1.0),
    (r"\boxed{30^\circ}", r"30^{\circ}", 1.0),
    (r"\boxed{k = 5}", "5", 1.0),  # a short "name =" prefix is dropped
    (r"\boxed{5}", "x=5", 1.0),
    (r"\boxed{(-\infty, 2]}", r"(-\infty,2]", 1.0),
    (r"\boxed{[1, 2)}", "[1,2]", 0.0),
    (r"\boxed{\pi}", "3.14159", 0.0),
    (r"\boxed{\frac{1}{3}}", "0.33", 0.0),
    (r"\boxed{\tfrac{1}{4}}", "0.25", 1.0),
    (r"\boxed{-5}", "- 5", 1.0),
    (r"\boxed{2x}", "2*x", 1.0),
]


# Where clawrl differs from slime on purpose (each is a line in docs/rewards.md).
DELIBERATE_DIFFERENCE_CASES = [
    (r"\boxed{0}", 0, 1.0),  # slime: a falsy label scores every response 0
    (r"\fbox{12}", "12", 1.0),  # slime: no answer in \fbox
    (r"\boxed 12", "12", 1.0),  # slime: no answer in the brace-less form
    (r"\boxed 12<|im_end|>", "12", 1.0),  # ... which runs to the end, so the end token must go first
    (r"\boxed{-7\frac{3}{4}}", r"-\frac{31}{4}", 1.0),  # slime: -7 + 3/4
    (r"\boxed{1\,000}", "1000", 1.0),  # slime: 1 + 000
    (r"\boxed{7 3/4}", "73/4", 0.0),  # slime accepts it through its first normalisation
    (r"\boxed{\pi+\sqrt{x}}", r"\sqrt{x}+\pi", 1.0),  # slime counts p and i as unknowns: too many
]


@pytest.mark.parametrize(
    "response,label,expected", MATH_CASES + SLIME_MATH_CASES + DELIBERATE_DIFFERENCE_CASES
)
def test_math_reward(response, label, expected):
    assert _math(response, label) == expected


@pytest.mark.parametrize(
    "raw,normalised",
    [
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"\sqrt2", r"\sqrt{2}"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"\$1,000.50", "1000.50"),
        (r"x = \frac{3}{4}\,\text{cm}", r"\frac{3}{4}"),
        ("2m+1", "2m+1"),  # a one-letter unit is only dropped inside \text{}
        ("(1,000, 2)", "(1,000,2)"),  # commas inside a tuple are not thousands separators
        (r"\text{Monday}", "monday"),  # text is lower-cased ...
        (r"\Delta ABC", r"\Deltaabc"),  # ... but not LaTeX command names
        ("7 3/4", r"7\frac{3}{4}"),  # mixed number, not 73/4
        (r"\{1, 2\}", "1,2"),
        (r"10\text{ apples}", "10"),
        (r"\text{ apples}", "apples"),  # a \text{ } with nothing before it is the answer itself
        (r"2 \text{ or } 3", "2,3"),
        (r"\cfrac{1}{2}", r"\frac{1}{2}"),
    ],
)
def test_normalise_answer(raw, normalised):
    assert normalise_answer(raw) == normalised


def test_last_boxed_content_nested_and_last():
    assert last_boxed_content(r"\boxed{a} and \boxed{\frac{1}{\sqrt{2}}} end") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed_content("no box") is None


def test_unsafe_input_never_reaches_sympy():
    assert to_sympy_source("__import__('os').system('true')") is None
    assert to_sympy_source("x.func") is None
    assert to_sympy_source("1" * 300) is None  # over the length limit
    assert to_sympy_source("chr(65)") == "c*h*r(65)"  # unknown words become single-letter symbols
    assert sympy_equal("__import__('os')", "0") is False


def test_sympy_heavy_input_returns_within_its_time_limit():
    assert sympy_equal("x+1", "1+x")  # start a warm worker so only the comparison is timed below
    start = time.monotonic()
    # 9^(9^9) has ~370 million digits: sympy would compute for minutes inside one C call.
    reward = _math(r"\boxed{9^{9^{9}}}", "9^{9^{9}}+1", sympy_timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert reward == 0.0
    assert elapsed < 2.5, elapsed  # 1 s limit + 0.5 s grace before the worker is killed
    # The killed worker is replaced: the next comparison works.
    assert _math(r"\boxed{\sqrt{8}}", r"2\sqrt{2}") == 1.0


def test_worker_that_overruns_is_killed_by_the_caller_and_replaced():
    # Drive one worker at the protocol level with a generous worker-side limit (60 s) so that only the
    # caller's own deadline can end the wait: the path taken when sympy is stuck in uninterruptible C code.
    worker = _Worker()
    assert worker.compare("x+1", "1+x", timeout_s=5.0) is True
    process = worker._proc
    process.stdin.write(json.dumps({"a": "9**(9**9)", "b": "x", "timeout_s": 60}).encode() + b"\n")
    start = time.monotonic()
    assert worker._read_line(time.monotonic() + 1.0) is None
    assert time.monotonic() - start < 1.5
    worker.stop()
    assert process.poll() is not None  # the process is gone
    assert worker.compare("2*x", "x+x", timeout_s=5.0) is True  # and a fresh one answers
    worker.stop()
