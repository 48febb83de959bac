"""Offline prompt sources: chat records made from what every machine has, for `data regenerate`
to answer with the target (docs/DATA.md, "Prompt sources").

A drafter serves the kinds of text it was trained on: one trained on regenerated ShareGPT accepts
far fewer tokens on code and arithmetic prompts, which ShareGPT holds little of, than on held-out
ShareGPT (docs/QUALITY.md). These sources add such prompts without a download and without any
evaluation set:

- `python-functions`: functions of the running Python's standard library that have a docstring.
  The prompt is the function's signature and docstring, as a request to implement it (one of a
  few wordings); the reference reply is the function's own source.
- `python-packages`: the same, from the installed libraries a dflash-train install brings
  (`PACKAGES`: torch, transformers and the packages they depend on, those of them that are
  installed, or `--packages`), located with importlib.util.find_spec and read as files, never
  imported. Their ids carry each package's installed version.
- `word-problems`: arithmetic word problems generated from a seed (shopping, change, sharing,
  rates, discounts, ages, production, distances, savings, fractions of a group), two to four
  steps each; the reference reply is a worked solution ending in its answer.

Records are ShareGPT JSONL lines (`id`, `source`, `conversations`: one human turn, one gpt turn)
that every reader here takes as chat data; `data regenerate` replaces the reference reply with
the target's. A record depends only on (source, seed, position) and, for python-functions and
python-packages, on the standard library of the Python that runs it or the installed packages'
versions (in every id).
"""

from __future__ import annotations

import ast
import concurrent.futures
import importlib.metadata
import importlib.util
import itertools
import json
import multiprocessing
import os
import random
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from dflash_train.core.assets import atomic_write_lines
from dflash_train.core.errors import InputError, output_file_problem

# Parts of the standard library that are not library code a user writes (tests, demos, IDLE,
# vendored installers, generated tables), or whose functions are mostly private plumbing.
SKIPPED_PARTS = {"test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages", "lib2to3", "ensurepip",
                 "pydoc_data", "encodings", "__pycache__", "__phello__", "venv", "testing", "_vendor", "vendored",
                 "benchmarks", "examples"}
# python-packages by default: the libraries a dflash-train install brings (its dependencies and the
# packages they pull in), those of them installed; import names, in this order
PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "huggingface_hub", "datasets", "numpy", "sympy",
            "networkx", "jinja2", "fsspec", "yaml", "tqdm", "packaging", "requests")
MIN_LINES, MAX_LINES = 4, 60  # a function's lines, signature and docstring included
MIN_DOC_CHARS = 20
MAX_FILE_BYTES = 400_000
PARALLEL_FILES = 200  # library_functions parses at least this many files in several processes

CODE_WORDINGS = (
    "Implement the following Python function.\n\n```python\n{code}\n```",
    "Complete this Python function so that it does what its docstring says:\n\n```python\n{code}\n```",
    "Write the body of the function below.\n\n```python\n{code}\n```",
    "Here is the signature and docstring of a Python function. Write the full function.\n\n```python\n{code}\n```",
    "```python\n{code}\n```\nFinish the implementation of `{name}`.",
)
METHOD_NOTE = "\n\n`{name}` is a method of the class `{owner}` in the `{module}` module."


@dataclass(frozen=True)
class Function:
    module: str
    qualname: str
    owner: str | None  # the class of a method
    prompt_code: str  # decorators, signature and docstring
    source: str  # the whole function


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _library_files(root: Path) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts[:-1])
        if parts & SKIPPED_PARTS or path.name.startswith(("test_", "_test")):
            continue
        try:
            if path.stat().st_size <= MAX_FILE_BYTES:
                files.append(path)
        except OSError:
            continue
    return files


def _is_stub(body: list[ast.stmt]) -> bool:
    """Whether what follows the docstring does nothing worth writing: pass, ..., or a bare raise."""
    if len(body) != 1:
        return False
    stmt = body[0]
    return (isinstance(stmt, ast.Pass) or isinstance(stmt, ast.Raise)
            or (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)))


def _function(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef, module: str,
              owner: str | None) -> Function | None:
    doc = ast.get_docstring(node)
    if node.name.startswith("_") or not doc or len(doc.strip()) < MIN_DOC_CHARS:
        return None
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    end = node.end_lineno or node.lineno
    rest = node.body[1:]
    if not MIN_LINES <= end - start + 1 <= MAX_LINES or not rest or _is_stub(rest):
        return None
    doc_end = node.body[0].end_lineno or node.body[0].lineno
    prompt = textwrap.dedent("".join(lines[start - 1: doc_end]))
    source = textwrap.dedent("".join(lines[start - 1: end]))
    if "\t" in source:  # mixed indentation dedents badly; rare in the standard library
        return None
    qualname = f"{owner}.{node.name}" if owner else node.name
    return Function(module, qualname, owner, prompt.rstrip() + "\n", source.rstrip() + "\n")


def _file_functions(path: Path, root: Path, package: str | None) -> list[Function]:
    """The documented public functions and methods (one class level) of one library file, in
    source order (none when it does not parse)."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return []
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    module = ".".join(((package,) if package else ()) + parts)
    if not module:
        return []
    lines = text.splitlines(keepends=True)
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            candidates = [(node, None)]
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            candidates = [(n, node.name) for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        else:
            continue
        for fn, owner in candidates:
            f = _function(lines, fn, module, owner)
            if f is not None:
                found.append(f)
    return found


def _files_functions(job: tuple[list[Path], Path, str | None]) -> list[list[Function]]:
    files, root, package = job
    return [_file_functions(path, root, package) for path in files]


def _parse_workers(num_files: int, workers: int | None) -> int:
    """Processes for parsing `num_files` files: `workers`, or (None) one per CPU up to 16 once
    there are PARALLEL_FILES files (a process's start costs more than parsing a few)."""
    if workers is not None:
        return max(1, int(workers))
    return 1 if num_files < PARALLEL_FILES else max(1, min(16, os.cpu_count() or 1))


def library_functions(root: Path | None = None, package: str | None = None,
                      workers: int | None = None) -> list[Function]:
    """The documented public functions and methods (one class level) of the library under
    `root` (the standard library), in file and source order; with `package`, `root` is that
    package's folder and module names start with it. The files are parsed in `workers`
    processes (None: _parse_workers), the result the same as in one: torch's and transformers'
    thousands of files are slow to parse in one process."""
    root = root or stdlib_root()
    files = _library_files(root)
    n = _parse_workers(len(files), workers)
    if n == 1:
        return [f for path in files for f in _file_functions(path, root, package)]
    # Contiguous slices, a few per process, so the order is the files' order; spawned, not
    # forked: the caller may hold threads (tokenizers, torch) that a fork copies mid-lock.
    step = max(1, -(-len(files) // (4 * n)))
    jobs = [(files[i: i + step], root, package) for i in range(0, len(files), step)]
    with concurrent.futures.ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        return [f for part in pool.map(_files_functions, jobs) for found in part for f in found]


def _code_records(source: str, functions: list[tuple[str, Function]], seed: int) -> Iterator[dict]:
    """(tag, function) pairs as records of `source`, in an order shuffled by `seed`; the tag
    (the Python's or the package's version) is the id's second part."""
    rng = random.Random(seed)
    rng.shuffle(functions)
    for tag, f in functions:
        wording = rng.choice(CODE_WORDINGS)
        prompt = wording.format(code=f.prompt_code.rstrip("\n"), name=f.qualname.split(".")[-1])
        if f.owner:
            prompt += METHOD_NOTE.format(name=f.qualname.split(".")[-1], owner=f.owner, module=f.module)
        reply = f"```python\n{f.source.rstrip()}\n```"
        yield _record(f"{source}/{tag}/{f.module}.{f.qualname}", source, prompt, reply)


def python_function_records(seed: int = 0, root: Path | None = None) -> Iterator[dict]:
    """Every documented function of the standard library as a record, in an order shuffled by
    `seed`."""
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    yield from _code_records("python-functions", [(version, f) for f in library_functions(root)], seed)


def package_root(name: str) -> Path | None:
    """The folder of the installed package `name` (an import name), found without importing it;
    None when no such package (a folder with modules) is installed."""
    if not name.isidentifier():
        return None
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations and Path(locations[0]).is_dir() else None


def package_version(name: str, distributions: dict[str, list[str]] | None = None) -> str:
    """The installed version of the distribution that provides import name `name`
    (`distributions`: importlib.metadata.packages_distributions(), when the caller has it)."""
    distributions = importlib.metadata.packages_distributions() if distributions is None else distributions
    for dist in distributions.get(name, []) + [name]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def installed_packages(packages: tuple[str, ...] | list[str] | None = None) -> list[str]:
    """The packages python-packages reads: `packages`, each of which must be installed, or the
    installed ones of PACKAGES."""
    if packages is None:
        return [name for name in PACKAGES if package_root(name) is not None]
    missing = [name for name in packages if package_root(name) is None]
    if missing:
        raise InputError(f"--packages: not installed here: {', '.join(missing)} (give import names whose package "
                         f"folder importlib finds, e.g. torch, yaml); install them or leave them out")
    return list(packages)


def python_package_records(seed: int = 0, packages: tuple[str, ...] | list[str] | None = None) -> Iterator[dict]:
    """Every documented function of the installed packages (installed_packages) as a record,
    all packages shuffled together by `seed`."""
    functions = []
    distributions = importlib.metadata.packages_distributions()  # one scan of the installed ones
    for name in installed_packages(packages):
        tag = f"{name}-{package_version(name, distributions)}"
        functions += [(tag, f) for f in library_functions(package_root(name), package=name)]
    yield from _code_records("python-packages", functions, seed)


# --------------------------------------------------------------------------- word problems

PRONOUNS = {"Ava": "she", "Ben": "he", "Chloe": "she", "Daniel": "he", "Emma": "she", "Felix": "he", "Grace": "she",
            "Hassan": "he", "Isla": "she", "Jonas": "he", "Kira": "she", "Liam": "he", "Maya": "she", "Noah": "he",
            "Olivia": "she", "Priya": "she", "Quinn": "they", "Rosa": "she", "Samir": "he", "Tara": "she", "Umar": "he",
            "Vera": "she", "Wei": "he", "Ximena": "she", "Yusuf": "he", "Zoe": "she"}
NAMES = tuple(PRONOUNS)
GOODS = ("notebook", "pencil", "apple", "sandwich", "ticket", "candle", "plant", "bottle of juice", "box of tea",
         "comic book", "pair of socks", "bag of rice")
THINGS = ("marbles", "stickers", "cookies", "stamps", "seashells", "crayons", "beads", "trading cards")
SUFFIXES = ("", "", "\nShow your work.", "\nExplain each step.", "\nThink it through step by step.",
            "\nGive the final answer at the end.")


def _plural(noun: str) -> str:
    head, sep, tail = noun.partition(" of ")
    head = head[:-1] + "ies" if head.endswith("y") and head[-2] not in "aeiou" else head + (
        "es" if head.endswith(("s", "x", "ch", "sh")) else "s")
    return head + sep + tail


def _verb(pronoun: str, singular: str, plural: str) -> str:
    return plural if pronoun == "they" else singular


def _shopping(rng: random.Random, name: str, p: str) -> tuple[str, list[str], int]:
    g1, g2 = rng.sample(GOODS, 2)
    a, b, x, y = rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 15), rng.randint(2, 15)
    q = (f"{name} buys {a} {_plural(g1)} at ${x} each and {b} {_plural(g2)} at ${y} each. "
         f"How much money does {name} spend in all?")
    steps = [f"The {_plural(g1)} cost {a} x ${x} = ${a * x}.", f"The {_plural(g2)} cost {b} x ${y} = ${b * y}.",
             f"In all: ${a * x} + ${b * y} = ${a * x + b * y}."]
    return q, steps, a * x + b * y


def _change(rng: random.Random, name: str, p: str) -> tuple[str, list[str], int]:
    g = rng.choice(GOODS)
    a, x = rng.randint(2, 8), rng.randint(3, 12)
    total = a * x
    bill = next(b for b in (20, 50, 100, 200) if b > total)
    q = (f"{name} buys {a} {_plural(g)} that cost ${x} each and pays with a ${bill} bill. "
         f"How much change does {name} get back?")
    steps = [f"The {_plural(g)} cost {a} x ${x} = ${total}.", f"The change is ${bill} - ${total} = ${bill - total}."]
    return q, steps, bill - total


def _sharing(rng: random.Random, name: str, p: str) -> tuple[str, list[str], int]:
    t = rng.choice(THINGS)
    friends, each = rng.randint(2, 7), rng.randint(2, 9)
    left = rng.randint(0, 20)
    n = friends * each + left
    q = f"{name} has {n} {t}. {p.capitalize()} {_verb(p, 'gives', 'give')} {each} {t} to each of {friends} friends. " \
        f"How many {t} does {name} have left?"
    steps = [f"{name} gives away {friends} x {each} = {friends * each} {t}.",
             f"{n} - {friends * each} = {left} {t} are left."]
    return q, steps, left


def _rate(rng: random.Random, name: str, p: str) -> tuple[str, list[str], int]:
    per_day, weeks = rng.randint(3, 40), rng.randint(2, 6)
    activity, unit = rng.choice((("reads", "pages"), ("walks", "kilometers"), ("writes", "lines of code"),
                                 ("practices piano for", "minutes")))  # the name is the subject: singular
    q = f"{name} {activity} {per_day} {unit} every day. How many {unit} is that in {weeks} weeks?"
    days = 7 * weeks
    steps = [f"{weeks} weeks have 7 x {weeks} = {days} days.", f"{per_day} x {days} = {per_day * days} {unit}."]
    return q, steps, per_day * days


def _discount(rng: random.Random, name: str, p: str) -> tuple[str, list[str], int]:
    g = rng.choice(("jacket", "bicycle", "lamp", "backpack", "guitar", "printer", "chair"))
    pct = rng.choice((10, 20, 25, 50))
    price = 20 * rng.randint(2, 40)  # a multiple of 20: every discount is whole dollars
    off = price * pct // 100
    q = f"A {g} costs ${price}. It is on sale for {pct}% off. {name} buys it. How much does {name} pay?"
    steps = [f"The discount is {pct}% of ${price} = ${off}.", f"{name} pays ${price} - ${off} = ${price - off}."]
    return q, steps, price - off


def _ages(rng: random.Random, name: str, p: str) -> tuple[str, list[str], int]:
    other = rng.choice([n for n in NAMES if n != name])
    young, gap, later = rng.randint(4, 30), rng.randint(2, 15), rng.randint(2, 10)
    q = (f"{name} is {gap} years older than {other}. {other} is {young} years old. "
         f"What will the sum of their ages be in {later} years?")
    old = young + gap
    steps = [f"{name} is {young} + {gap} = {old} years old.",
             f"In {later} years {other} will be {young + later} and {name} will be {old + later}.",
             f"The sum is {young + later} + {old + later} = {young + old + 2 * later}."]
    return q, steps, young + old + 2 * later


def _production(rng: random.Random, name: str, p: str) -> tuple[str, list[str], int]:
    trays, per_tray, days = rng.randint(3, 12), rng.randint(6, 24), rng.randint(2, 6)
    made = trays * per_tray
    sold = rng.randint(made // 3, made - 1)
    q = (f"{name}'s bakery makes {trays} trays of {per_tray} muffins every day and sells {sold} muffins a day. "
         f"How many muffins are left over after {days} days?")
    steps = [f"Each day the bakery makes {trays} x {per_tray} = {made} muffins.",
             f"Each day {made} - {sold} = {made - sold} are left over.",
             f"After {days} days: {made - sold} x {days} = {(made - sold) * days} muffins."]
    return q, steps, (made - sold) * days


def _distance(rng: random.Random, name: str, p: str) -> tuple[str, list[str], int]:
    s1, t1, s2, t2 = rng.randint(30, 90), rng.randint(1, 5), rng.randint(20, 70), rng.randint(1, 4)
    q = (f"{name} drives at {s1} km per hour for {t1} hours, then at {s2} km per hour for {t2} hours. "
         f"How far does {name} drive in total?")
    steps = [f"First part: {s1} x {t1} = {s1 * t1} km.", f"Second part: {s2} x {t2} = {s2 * t2} km.",
             f"Total: {s1 * t1} + {s2 * t2} = {s1 * t1 + s2 * t2} km."]
    return q, steps, s1 * t1 + s2 * t2


def _savings(rng: random.Random, name: str, p: str) -> tuple[str, list[str], int]:
    g = rng.choice(("game console", "tablet", "skateboard", "telescope", "camera"))
    weekly, weeks, have = rng.randint(5, 40), rng.randint(3, 20), rng.randint(10, 120)
    cost = have + weekly * weeks
    q = (f"{name} wants a {g} that costs ${cost}. {p.capitalize()} already {_verb(p, 'has', 'have')} ${have} and "
         f"{_verb(p, 'saves', 'save')} ${weekly} every week. How many weeks does {name} need to save?")
    steps = [f"{name} still needs ${cost} - ${have} = ${cost - have}.",
             f"${cost - have} / ${weekly} per week = {weeks} weeks."]
    return q, steps, weeks


def _fractions(rng: random.Random, name: str, p: str) -> tuple[str, list[str], int]:
    k = rng.choice((2, 3, 4, 5))
    n = k * 2 * rng.randint(3, 15)
    q = (f"There are {n} students in {name}'s grade. 1/{k} of them play football, and half of the rest play chess. "
         f"How many students play neither?")
    football = n // k
    rest = n - football
    steps = [f"1/{k} of {n} is {football} students who play football.", f"{n} - {football} = {rest} are left.",
             f"Half of {rest} is {rest // 2} who play chess, so {rest - rest // 2} play neither."]
    return q, steps, rest - rest // 2


PROBLEMS: tuple[Callable[[random.Random, str, str], tuple[str, list[str], int]], ...] = (
    _shopping, _change, _sharing, _rate, _discount, _ages, _production, _distance, _savings, _fractions)


def word_problem(seed: int, index: int) -> tuple[str, str, int]:
    """Problem `index` of `seed`: (question, worked solution, answer)."""
    rng = random.Random(f"word-problems/{seed}/{index}")
    name = rng.choice(NAMES)
    question, steps, answer = rng.choice(PROBLEMS)(rng, name, PRONOUNS[name])
    return question + rng.choice(SUFFIXES), "\n".join(steps + [f"The answer is {answer}."]), answer


def word_problem_records(seed: int = 0) -> Iterator[dict]:
    index = 0
    while True:
        question, solution, _ = word_problem(seed, index)
        yield _record(f"word-problems/{seed}/{index}", "word-problems", question, solution)
        index += 1


# --------------------------------------------------------------------------- the command

SOURCES: dict[str, Callable[[int], Iterator[dict]]] = {
    "python-functions": python_function_records,
    "python-packages": python_package_records,
    "word-problems": word_problem_records,
}


def _record(record_id: str, source: str, prompt: str, reply: str) -> dict:
    return {"id": record_id, "source": source,
            "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]}


def write_source(name: str, out: str | Path, limit: int | None = None, seed: int = 0,
                 packages: list[str] | None = None, replace: bool = False) -> int:
    """Write the first `limit` records (all: None; word-problems has no end, so it needs one)
    of source `name` to the JSONL file `out` (atomically); `packages`: python-packages' list
    (None: installed_packages()). An existing `out` is replaced only when it is an earlier output
    of the same source and seed (other_records_problem) or `replace` says so; else InputError and
    nothing is written. Returns the count."""
    problems = []
    if name not in SOURCES:
        problems.append(f"--source {name!r} is not a prompt source; choose one of {', '.join(SOURCES)}")
    if packages is not None and name != "python-packages":
        problems.append(f"--packages is an option of --source python-packages, not of {name}")
    if packages is not None and not packages:
        problems.append("--packages names no package: give import names separated by commas, e.g. torch,sympy")
    if limit is not None and limit < 1:
        problems.append(f"--limit must be >= 1, got {limit}")
    if limit is None and name == "word-problems":
        problems.append("--source word-problems generates without end: give --limit N")
    problem = output_file_problem(out)
    if problem:
        problems.append(f"--out {out}: {problem}")
    if problems:
        raise InputError("; ".join(problems))
    records = python_package_records(seed, packages) if name == "python-packages" else SOURCES[name](seed)
    lines = [json.dumps(record, ensure_ascii=False) + "\n" for record in itertools.islice(records, limit)]
    problem = None if replace else other_records_problem(Path(out), lines)
    if problem:
        raise InputError(f"--out {out} exists, and its {problem} than `data source --source {name} --seed {seed}` "
                         f"writes there (chats of yours? a regeneration?): writing would replace the file; choose "
                         f"another --out, or pass --force to replace it")
    atomic_write_lines(Path(out), lines)
    return len(lines)


def other_records_problem(out: Path, lines: list[str]) -> str | None:
    """Where writing `lines` to `out` would lose records: `out` exists and holds other lines than
    an earlier output of the same source and seed (the same lines, more or fewer of them: a rerun,
    another --limit). None when it does not exist, is empty or is such an output."""
    if not out.is_file():
        return None
    with open(out, encoding="utf-8", errors="replace") as f:
        for number, (old, new) in enumerate(zip(f, lines), 1):
            if old.rstrip("\n") != new.rstrip("\n"):
                return f"line {number} holds another record"
    return None
