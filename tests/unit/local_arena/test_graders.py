"""The exact_match and python_tests graders, including the python sandbox."""

from __future__ import annotations

import socket
import time

import pytest

from examples.swe.local_arena import graders, sandbox
from examples.swe.local_arena.graders import extract_code, extract_last_number, grade
from examples.swe.local_arena.types import DatasetRow, GraderError, RewardSpec

EXACT = RewardSpec("exact-match", "1.0.0", "exact_match")
TESTS = RewardSpec("python-tests", "1.0.0", "python_tests", {"timeout": 5})


def _row(**grading) -> DatasetRow:
    return DatasetRow("q1", "prompt", grading)


# --- exact_match ---


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("The answer is 7.", "7"),
        ("3 + 4 = 7", "7"),  # the last number, not the first
        ("5-3=2", "2"),  # "-3" after a digit is subtraction, not a negative number
        ("It drops to -3 degrees", "-3"),
        ("That makes 1,000 apples", "1000"),
        ("It costs $2.50 today.", "2.50"),
        ("so \\boxed{12} and then 13 more words", "12"),  # a box beats the last number
        ("\\boxed{\\frac{6}{2} = 3}", "3"),
        ("Step1 gives five", "5"),  # no free-standing digit: the number word
        ("no numbers at all", None),
        ("", None),
    ],
)
def test_extract_last_number(text, number):
    assert extract_last_number(text) == number


@pytest.mark.parametrize(
    ("answer", "expected", "score"),
    [
        ("The answer is 5.", "5", 1.0),
        ("Tom has 3 + 2 = 5 apples.", 5, 1.0),  # a numeric expected value
        ("I think 5. No wait, it is 6", "6", 1.0),
        ("I think 5. No wait, it is 6", "5", 0.0),
        ("5.0", "5", 1.0),  # compared as numbers, not strings
        ("1,000", "1000", 1.0),
        ("The answer is Paris.", "Paris", 1.0),
        ("  PARIS  ", "paris", 1.0),
        ("Answer: **Paris**!", "Paris", 1.0),
        ("London", "Paris", 0.0),
        ("", "5", 0.0),
    ],
)
def test_exact_match_scores(answer, expected, score):
    assert grade(EXACT, _row(answer=expected), answer).score == score


def test_exact_match_detail_names_expected_and_extracted():
    result = grade(EXACT, _row(answer="12"), "7 + 5 = 12, so 12 it is... or 13")
    assert result.score == 0.0
    assert result.detail == {"mode": "numeric", "expected": "12", "extracted": "13"}


def test_numeric_tolerance_option():
    tolerant = RewardSpec("exact-match", "2", "exact_match", {"numeric_tolerance": 0.01})
    assert grade(tolerant, _row(answer="3.14"), "about 3.1416").score == 1.0  # |0.0016| <= 0.01
    assert grade(tolerant, _row(answer="3.14"), "about 3.16").score == 0.0  # |0.02| > 0.01


@pytest.mark.parametrize(
    ("reward", "grading", "message"),
    [
        (EXACT, {}, "missing field 'answer'"),
        (EXACT, {"answer": ["4"]}, "string or a number"),
        (EXACT, {"answer": "4", "answr": "4"}, "unknown field 'answr'"),
        (RewardSpec("x", "1", "fuzzy_match"), {"answer": "4"}, "unknown grader"),
        (RewardSpec("x", "1", "exact_match", {"tolerance": 1}), {"answer": "4"}, "unknown field"),
        (TESTS, {"tests": "assert (("}, "not valid Python"),
        (TESTS, {"tests": "x = 1"}, "no assert statement"),
        (TESTS, {"tests": "assert f()", "entry_point": "not a name"}, "Python name"),
        (RewardSpec("x", "1", "python_tests", {"timeout": 0}), {"tests": "assert 1"}, "positive"),
    ],
)
def test_unusable_grading_data_is_a_grader_error(reward, grading, message):
    with pytest.raises(GraderError, match=message):
        grade(reward, _row(**grading), "anything")


# --- python_tests: extracting and splitting ---


@pytest.mark.parametrize(
    ("answer", "code"),
    [
        ("```python\na = 1\n```\ntext\n```python\nb = 2\n```", "b = 2\n"),  # the last python block
        ("```python\na = 1\n```\n```text\nnot code\n```", "a = 1\n"),  # python beats other langs
        ("Sure:\n```\nc = 3\n```\nDone.", "c = 3\n"),  # any fenced block
        ("d = 4", "d = 4"),  # no fence: the whole text
        ("```py\ne = 5\n", "e = 5\n"),  # cut off before the closing fence
    ],
)
def test_extract_code(answer, code):
    assert extract_code(answer) == code


def test_setup_statements_do_not_count_as_tests():
    statements = graders._split_tests(
        "import math\nassert math.pi > 3\nfor x in [1]:\n    assert x"
    )
    assert [is_test for _, is_test in statements] == [False, True, True]


# --- python_tests: running ---

ADD_TESTS = "import math\nassert add(1, 2) == 3\nassert add(2, 2) == 4\nassert add(0, 0) == 0"


def test_a_correct_function_scores_one():
    result = grade(TESTS, _row(entry_point="add", tests=ADD_TESTS), "def add(a, b): return a + b")
    assert result.score == 1.0
    assert result.detail["passed"] == result.detail["total"] == 3  # the import is setup
    assert result.detail["failures"] == []


def test_score_is_the_fraction_of_passing_asserts():
    # a * b: 1*2=2 (fails), 2*2=4 (passes), 0*0=0 (passes) -> 2 of 3
    result = grade(TESTS, _row(entry_point="add", tests=ADD_TESTS), "def add(a, b): return a * b")
    assert result.score == pytest.approx(2 / 3)
    assert result.detail["failures"] == [
        {"statement": "assert add(1, 2) == 3", "error": "AssertionError"}
    ]


def test_a_syntax_error_scores_zero_without_running():
    result = grade(TESTS, _row(entry_point="add", tests=ADD_TESTS), "def add(a, b) return a")
    assert result.score == 0.0
    assert "syntax_error" in result.detail


def test_a_missing_entry_point_scores_zero():
    result = grade(TESTS, _row(entry_point="add", tests=ADD_TESTS), "def plus(a, b): return a + b")
    assert result.score == 0.0
    assert result.detail["entry_point_missing"] == "add"


def test_an_infinite_loop_times_out_with_score_zero():
    quick = RewardSpec("python-tests", "1.0.0", "python_tests", {"timeout": 1})
    started = time.monotonic()
    result = grade(quick, _row(tests="assert spin()"), "def spin():\n    while True:\n        pass")
    assert time.monotonic() - started < 3
    assert result.score == 0.0
    assert result.detail["timeout"] is True


def test_a_crash_part_way_keeps_the_tests_before_it():
    answer = "import os\ndef ok(): return True\ndef die(): os._exit(3)"
    result = grade(TESTS, _row(tests="assert ok()\nassert die()\nassert ok()"), answer)
    assert result.score == pytest.approx(1 / 3)
    assert result.detail["crashed"] is True
    assert result.detail["exit_code"] == 3


@pytest.fixture
def listener():
    """A TCP port on this machine that accepts connections, to aim the candidate at."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0)
    yield server
    server.close()


def _nobody_connected(server: socket.socket) -> bool:
    try:
        server.accept()[0].close()
    except BlockingIOError:
        return True
    return False


def test_the_socket_guard_blocks_connections_even_without_a_namespace(listener, monkeypatch):
    monkeypatch.setattr(sandbox, "unshare_prefix", lambda pid=False: ())
    port = listener.getsockname()[1]
    answer = (
        "import socket\n"
        "def blocked():\n"
        "    try:\n"
        f"        socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "    except OSError:\n"
        "        return True\n"
        "    return False\n"
    )
    result = grade(TESTS, _row(tests="assert blocked()"), answer)
    assert result.score == 1.0, result.detail
    assert _nobody_connected(listener)


@pytest.mark.skipif(
    not sandbox.unshare_prefix(pid=True), reason="no network namespace on this machine"
)
def test_raw_sockets_cannot_connect_inside_the_namespace(listener):
    # _socket is below the guard in the socket module; only the namespace stops it.
    port = listener.getsockname()[1]
    answer = (
        "import _socket\n"
        "def blocked():\n"
        "    s = _socket.socket()\n"
        "    s.settimeout(1)\n"
        f"    return s.connect_ex(('127.0.0.1', {port})) != 0\n"
    )
    result = grade(TESTS, _row(tests="assert blocked()"), answer)
    assert result.score == 1.0, result.detail
    assert _nobody_connected(listener)


def test_the_child_sees_a_bare_environment_and_short_output(monkeypatch):
    monkeypatch.setenv("LOCAL_ARENA_TEST_SECRET", "hunter2")
    answer = "import os\nprint('x' * 100_000)\ndef environment():\n    return dict(os.environ)\n"
    tests = (
        "assert 'LOCAL_ARENA_TEST_SECRET' not in environment()\n"
        "assert set(environment()) <= {'PATH', 'HOME', 'LANG', 'LC_CTYPE'}\n"
        "assert environment()['HOME'] == os.getcwd()\n"
    )
    result = grade(TESTS, _row(tests=tests), answer)
    assert result.score == 1.0, result.detail
    assert len(result.detail["stdout"]) < 3000  # cut to a few KB


def test_memory_is_capped():
    small = RewardSpec("python-tests", "1.0.0", "python_tests", {"memory_mb": 512})
    answer = (
        "def allocation_fails():\n"
        "    try:\n"
        "        bytearray(1024 * 2**20)\n"
        "    except MemoryError:\n"
        "        return True\n"
        "    return False\n"
    )
    result = grade(small, _row(tests="assert allocation_fails()"), answer)
    assert result.score == 1.0, result.detail


# --- answer_length ---

LENGTH = RewardSpec("answer-length", "1.0.0", "answer_length", {"target_chars": 10})


@pytest.mark.parametrize(
    ("answer", "score"),
    [
        ("", 0.0),
        ("   abcde  ", 0.5),  # 5 of 10 characters once stripped
        ("0123456789", 1.0),
        ("a much longer answer than the target", 1.0),  # capped at 1
    ],
)
def test_answer_length_gives_partial_credit_for_any_row(answer, score):
    graded = grade(LENGTH, _row(answer="42"), answer)
    assert graded.score == pytest.approx(score)
    assert graded.detail["target_chars"] == 10


def test_answer_length_needs_a_positive_target():
    with pytest.raises(GraderError, match="target_chars"):
        grade(RewardSpec("l", "1", "answer_length", {"target_chars": 0}), _row(), "x")
