"""Synthetic HumanEval-shaped training prompts (none taken from HumanEval).

Each prompt is a Python function signature with type hints and a docstring holding a description
and ``>>>`` doctest examples whose outputs are computed by a reference implementation. Two
sources: templated tasks on lists/strings/numbers (randomised names, wording and examples), and
wrappers around standard-library functions (``str`` methods, ``math``) described by the first
line of their own docstrings.
"""

from __future__ import annotations

import math
import random
import string
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Task:
    names: tuple[str, ...]          # candidate function names
    params: str                     # "xs: List[int], k: int"
    returns: str                    # "List[int]"
    descs: tuple[str, ...]          # candidate descriptions
    ref: Callable                   # reference implementation
    gen: Callable[[random.Random], tuple]  # random argument tuple


def _ints(r, lo=-9, hi=20, n=None):
    return [r.randint(lo, hi) for _ in range(n if n is not None else r.randint(0, 7))]


def _word(r, n=None):
    return "".join(r.choice(string.ascii_lowercase) for _ in range(n or r.randint(2, 7)))


def _words(r):
    return [_word(r) for _ in range(r.randint(1, 5))]


def _sentence(r):
    return " ".join(_words(r))


def _floats(r):
    return [round(r.uniform(-5, 10), 1) for _ in range(r.randint(1, 6))]


TASKS: tuple[Task, ...] = (
    Task(("sum_of_evens", "even_sum", "add_even_numbers"), "numbers: List[int]", "int",
         ("Return the sum of the even numbers in the list.",
          "Given a list of integers, add up only the even ones and return the total."),
         lambda xs: sum(x for x in xs if x % 2 == 0), lambda r: (_ints(r),)),
    Task(("count_positive", "num_positive", "positives_count"), "values: List[int]", "int",
         ("Count how many numbers in the list are strictly greater than zero.",),
         lambda xs: sum(1 for x in xs if x > 0), lambda r: (_ints(r),)),
    Task(("running_max", "prefix_maximum", "rolling_max"), "numbers: List[int]", "List[int]",
         ("Return a list where element i is the maximum of numbers[0..i].",
          "From a list of integers, generate the list of rolling maximum elements seen so far."),
         lambda xs: [max(xs[:i + 1]) for i in range(len(xs))], lambda r: (_ints(r),)),
    Task(("second_largest", "runner_up"), "numbers: List[int]", "Optional[int]",
         ("Return the second largest distinct value in the list, or None if there is none.",),
         lambda xs: sorted(set(xs))[-2] if len(set(xs)) > 1 else None, lambda r: (_ints(r),)),
    Task(("remove_duplicates_keep_order", "unique_in_order", "dedupe"), "items: List[int]", "List[int]",
         ("Remove repeated values from the list, keeping the first occurrence of each.",),
         lambda xs: list(dict.fromkeys(xs)), lambda r: (_ints(r, 0, 5),)),
    Task(("chunk_list", "split_into_chunks", "batched"), "items: List[int], size: int", "List[List[int]]",
         ("Split the list into consecutive chunks of the given size; the last chunk may be shorter.",),
         lambda xs, k: [xs[i:i + k] for i in range(0, len(xs), k)],
         lambda r: (_ints(r), r.randint(1, 3))),
    Task(("rotate_left", "shift_left"), "items: List[int], k: int", "List[int]",
         ("Rotate the list to the left by k positions.",
          "Return a new list with the elements moved k places to the left, wrapping around."),
         lambda xs, k: xs[k % len(xs):] + xs[:k % len(xs)] if xs else [],
         lambda r: (_ints(r), r.randint(0, 5))),
    Task(("pairwise_differences", "consecutive_diffs", "deltas"), "numbers: List[int]", "List[int]",
         ("Return the differences between each element and the one before it.",),
         lambda xs: [b - a for a, b in zip(xs, xs[1:])], lambda r: (_ints(r),)),
    Task(("count_vowels", "vowel_count"), "text: str", "int",
         ("Count the vowels (a, e, i, o, u) in the string, ignoring case.",),
         lambda s: sum(c in "aeiou" for c in s.lower()), lambda r: (_sentence(r),)),
    Task(("reverse_words", "words_backwards"), "sentence: str", "str",
         ("Return the sentence with the order of its words reversed.",),
         lambda s: " ".join(s.split()[::-1]), lambda r: (_sentence(r),)),
    Task(("capitalize_words", "title_words"), "sentence: str", "str",
         ("Capitalize the first letter of every word in the sentence.",),
         lambda s: " ".join(w[:1].upper() + w[1:] for w in s.split()), lambda r: (_sentence(r),)),
    Task(("is_palindrome_word", "reads_same_backwards"), "word: str", "bool",
         ("Return True if the word reads the same forwards and backwards.",),
         lambda s: s == s[::-1], lambda r: (r.choice([_word(r), "level", "abba", "noon", _word(r, 3)]),)),
    Task(("char_frequency", "letter_counts"), "text: str", "Dict[str, int]",
         ("Return a dictionary mapping each character of the text to how often it occurs.",),
         lambda s: {c: s.count(c) for c in dict.fromkeys(s)}, lambda r: (_word(r),)),
    Task(("longest_word", "find_longest_word"), "sentence: str", "str",
         ("Return the longest word in the sentence; on ties return the first one.",),
         lambda s: max(s.split(), key=len) if s.split() else "", lambda r: (_sentence(r),)),
    Task(("compress_runs", "run_length_encode"), "text: str", "str",
         ("Encode runs of repeated characters as the character followed by the run length.",),
         lambda s: "".join(f"{c}{len(list(g))}" for c, g in __import__("itertools").groupby(s)),
         lambda r: ("".join(r.choice("aab") * r.randint(1, 3) for _ in range(r.randint(1, 4))),)),
    Task(("caesar_shift", "shift_letters"), "text: str, shift: int", "str",
         ("Shift every lowercase letter forward in the alphabet by shift places, wrapping from z to a.",),
         lambda s, k: "".join(chr((ord(c) - 97 + k) % 26 + 97) if c.islower() else c for c in s),
         lambda r: (_sentence(r), r.randint(1, 5))),
    Task(("digit_sum", "sum_of_digits"), "n: int", "int",
         ("Return the sum of the decimal digits of the non-negative integer n.",),
         lambda n: sum(map(int, str(n))), lambda r: (r.randint(0, 99999),)),
    Task(("is_prime", "check_prime"), "n: int", "bool",
         ("Return True if n is a prime number, otherwise False.",),
         lambda n: n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1)), lambda r: (r.randint(0, 100),)),
    Task(("fibonacci", "nth_fibonacci", "fib"), "n: int", "int",
         ("Return the n-th Fibonacci number, with fib(0) = 0 and fib(1) = 1.",),
         lambda n: (lambda f: f(f, n))(lambda f, k: k if k < 2 else f(f, k - 1) + f(f, k - 2)),
         lambda r: (r.randint(0, 15),)),
    Task(("gcd_of_list", "list_gcd"), "numbers: List[int]", "int",
         ("Return the greatest common divisor of all numbers in the non-empty list.",),
         lambda xs: math.gcd(*xs), lambda r: ([r.randint(1, 12) * r.choice([2, 3, 6]) for _ in range(r.randint(1, 4))],)),
    Task(("collatz_steps", "steps_to_one"), "n: int", "int",
         ("Return how many Collatz steps it takes for the positive integer n to reach 1.",),
         lambda n: (lambda f: f(f, n))(lambda f, k: 0 if k == 1 else 1 + f(f, k // 2 if k % 2 == 0 else 3 * k + 1)),
         lambda r: (r.randint(1, 30),)),
    Task(("to_binary", "binary_string"), "n: int", "str",
         ("Return the binary representation of the non-negative integer n without a prefix.",),
         lambda n: bin(n)[2:], lambda r: (r.randint(0, 200),)),
    Task(("mean_of", "average"), "values: List[float]", "float",
         ("Return the arithmetic mean of the non-empty list of numbers.",),
         lambda xs: sum(xs) / len(xs), lambda r: (_floats(r),)),
    Task(("clamp_values", "clip_all"), "values: List[float], low: float, high: float", "List[float]",
         ("Limit every value to the closed interval [low, high].",),
         lambda xs, lo, hi: [min(max(x, lo), hi) for x in xs], lambda r: (_floats(r), 0.0, 5.0)),
    Task(("normalize_scores", "scale_to_unit"), "values: List[float]", "List[float]",
         ("Linearly rescale the list so that its minimum becomes 0.0 and its maximum 1.0.",),
         lambda xs: [round((x - min(xs)) / (max(xs) - min(xs)), 3) for x in xs],
         lambda r: (sorted(set(_floats(r) + [0.0, 4.0])),)),
    Task(("merge_sorted", "merge_two_sorted_lists"), "a: List[int], b: List[int]", "List[int]",
         ("Merge two sorted lists into one sorted list.",),
         lambda a, b: sorted(a + b), lambda r: (sorted(_ints(r)), sorted(_ints(r)))),
    Task(("common_elements", "intersection_sorted"), "a: List[int], b: List[int]", "List[int]",
         ("Return the sorted list of values that appear in both lists, without duplicates.",),
         lambda a, b: sorted(set(a) & set(b)), lambda r: (_ints(r, 0, 8), _ints(r, 0, 8))),
    Task(("flatten", "flatten_once"), "nested: List[List[int]]", "List[int]",
         ("Flatten a list of lists into a single list.",),
         lambda xss: [x for xs in xss for x in xs], lambda r: ([_ints(r, 0, 9, r.randint(0, 3)) for _ in range(r.randint(1, 3))],)),
    Task(("group_by_length", "bucket_words"), "words: List[str]", "Dict[int, List[str]]",
         ("Group the words into a dictionary keyed by word length, keeping input order.",),
         lambda ws: {n: [w for w in ws if len(w) == n] for n in dict.fromkeys(len(w) for w in ws)},
         lambda r: (_words(r),)),
    Task(("filter_by_prefix", "words_starting_with"), "words: List[str], prefix: str", "List[str]",
         ("Return the words that start with the given prefix.",),
         lambda ws, p: [w for w in ws if w.startswith(p)], lambda r: (_words(r) + ["apple", "apply"], "ap")),
    Task(("count_words", "word_count"), "text: str", "Dict[str, int]",
         ("Return a dictionary that maps each word in the text to the number of times it appears.",),
         lambda s: {w: s.split().count(w) for w in dict.fromkeys(s.split())},
         lambda r: (" ".join(r.choice(["a", "b", "cat", "dog"]) for _ in range(r.randint(1, 6))),)),
    Task(("matrix_transpose", "transpose"), "matrix: List[List[int]]", "List[List[int]]",
         ("Return the transpose of a rectangular matrix given as a list of rows.",),
         lambda m: [list(c) for c in zip(*m)],
         lambda r: ((lambda c: [_ints(r, 0, 9, c) for _ in range(r.randint(1, 3))])(r.randint(1, 3)),)),
    Task(("max_subarray_sum", "best_contiguous_sum"), "numbers: List[int]", "int",
         ("Return the largest sum of a non-empty contiguous sub-list.",),
         lambda xs: max(sum(xs[i:j]) for i in range(len(xs)) for j in range(i + 1, len(xs) + 1)),
         lambda r: (_ints(r, -5, 6, r.randint(1, 6)),)),
    Task(("balanced_brackets", "brackets_ok"), "text: str", "bool",
         ("Return True if every opening bracket '(' has a matching closing bracket ')'.",),
         lambda s: (lambda d: all(x >= 0 for x in d) and (not d or d[-1] == 0))(
             list(__import__("itertools").accumulate(1 if c == "(" else -1 for c in s))),
         lambda r: ("".join(r.choice("()") for _ in range(r.randint(0, 6))),)),
    Task(("count_divisible", "multiples_in_range"), "start: int, stop: int, k: int", "int",
         ("Count the integers in range(start, stop) that are divisible by k.",),
         lambda a, b, k: sum(1 for x in range(a, b) if x % k == 0),
         lambda r: (r.randint(0, 10), r.randint(10, 40), r.randint(2, 7))),
)

_STR_METHODS = ("upper", "lower", "title", "swapcase", "capitalize", "strip", "isdigit", "isalpha",
                "isupper", "islower", "casefold", "isspace", "isalnum", "lstrip", "rstrip")
_MATH_FUNCS = ("sqrt", "floor", "ceil", "factorial", "log2", "exp", "fabs", "isqrt", "trunc")


def _first_line(doc: str | None) -> str:
    lines = [ln.strip() for ln in (doc or "").strip().splitlines() if ln.strip()]
    return lines[0] if lines else "Compute the result."


def _render(name: str, params: str, returns: str, desc: str, examples: list[tuple[str, object]],
            imports: str) -> str:
    doc = [f'    """ {desc}'] if "\n" not in desc else [f'    """ {desc}']
    for call, out in examples:
        doc += [f"    >>> {name}({call})", f"    {out!r}"]
    doc.append('    """')
    head = f"{imports}\n\n\n" if imports else ""
    return f"{head}def {name}({params}) -> {returns}:\n" + "\n".join(doc) + "\n"


def _imports(sig: str) -> str:
    used = [t for t in ("List", "Dict", "Optional", "Tuple") if t + "[" in sig]
    return f"from typing import {', '.join(used)}" if used else ""


def templated_prompt(r: random.Random) -> str:
    t = r.choice(TASKS)
    name = r.choice(t.names)
    examples = []
    for _ in range(r.randint(2, 3)):
        for _try in range(20):
            args = t.gen(r)
            try:
                out = t.ref(*args)
                break
            except (ValueError, ZeroDivisionError, TypeError):
                continue
        else:
            continue
        examples.append((", ".join(repr(a) for a in args), out))
    sig = f"{t.params} -> {t.returns}"
    return _render(name, t.params, t.returns, r.choice(t.descs), examples, _imports(sig))


def stdlib_prompt(r: random.Random) -> str:
    if r.random() < 0.5:
        meth = r.choice(_STR_METHODS)
        fn = getattr(str, meth)
        desc = _first_line(fn.__doc__).replace("Return", "Return", 1)
        name = r.choice([f"{meth}_text", f"apply_{meth}", f"string_{meth}"])
        ex = [(repr(s), fn(s)) for s in (r.choice([_sentence(r), " " + _word(r).upper() + " ", "123", _word(r).title()])
                                          for _ in range(r.randint(2, 3)))]
        ret = "bool" if meth.startswith("is") else "str"
        return _render(name, "text: str", ret, desc + " (like str." + meth + ")", ex, "")
    fname = r.choice(_MATH_FUNCS)
    fn = getattr(math, fname)
    name = r.choice([f"compute_{fname}", f"my_{fname}", f"{fname}_of"])
    if fname in ("factorial", "isqrt"):
        xs, ptype = [r.randint(0, 12) for _ in range(3)], "int"
    else:
        xs, ptype = [round(r.uniform(0.5, 9.5), 2) for _ in range(3)], "float"
    ret = "int" if fname in ("floor", "ceil", "factorial", "isqrt", "trunc") else "float"
    ex = [(repr(x), round(fn(x), 6) if ret == "float" else fn(x)) for x in xs[:r.randint(2, 3)]]
    return _render(name, f"x: {ptype}", ret, _first_line(fn.__doc__), ex, "")


def make_prompts(n: int, seed: int = 0, code_fraction: float = 0.0) -> list[str]:
    """``n`` distinct HumanEval-shaped prompts: ``code_fraction`` of them stubs of real functions
    (:mod:`dflash.train.code_prompts`), the rest synthetic (about 80% templated, 20% stdlib
    wrappers), shuffled together with ``seed``.

    Raises ``ValueError`` if ``code_fraction`` is outside [0, 1].
    """
    if not 0.0 <= code_fraction <= 1.0:
        raise ValueError(f"code_fraction: must be in [0, 1], got {code_fraction}")
    r = random.Random(seed)
    n_code = round(n * code_fraction)
    seen: dict[str, None] = {}
    tries = 0
    while len(seen) < n - n_code and tries < n * 50:
        tries += 1
        p = stdlib_prompt(r) if r.random() < 0.2 else templated_prompt(r)
        seen.setdefault(p, None)
    out = list(seen)
    if n_code:
        from dflash.train.code_prompts import code_prompts

        out += code_prompts(n_code, seed=seed)
        r.shuffle(out)
    return out
