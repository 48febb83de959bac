"""Offline prompt sources (sources.py): which functions of a library become code prompts and
what their prompts and replies hold, word problems whose worked solutions are right, the files
`data source` writes and that the chat reader and regeneration take."""

from __future__ import annotations

import itertools
import json
import re
import textwrap

import pytest

from dflash_train.app import cli
from dflash_train.data import chat_files, sources

LIBRARY = {
    "shapes.py": '''
        """A module."""
        import math


        def area(radius):
            """The area of a circle of this radius, in square units."""
            squared = radius * radius
            return math.pi * squared


        def _helper(x):
            """A private helper that is long enough to be documented."""
            y = x + 1
            return y


        def undocumented(x):
            y = x * 2
            z = y + 1
            return z


        def stub(x):
            """Does nothing yet, and says so at some length."""
            raise NotImplementedError


        @staticmethod
        def decorated(a, b):
            """Adds two numbers and returns their sum to the caller."""
            total = a + b
            return total


        class Square:
            """A square."""

            def __init__(self, side):
                self.side = side

            def perimeter(self):
                """The length of the square's boundary, four sides."""
                sides = 4
                return sides * self.side
        ''',
    "test/test_shapes.py": '''
        def check_area():
            """A test helper that must never become a prompt."""
            value = 1
            return value
        ''',
    "pkg/__init__.py": '''
        def version_tuple(text):
            """The dotted version string as a tuple of integers."""
            parts = text.split(".")
            return tuple(int(p) for p in parts)
        ''',
}


@pytest.fixture
def library(tmp_path):
    for name, text in LIBRARY.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    (tmp_path / "broken.py").write_text("def oops(:\n")
    return tmp_path


def test_library_functions_keeps_documented_public_code(library):
    found = {f"{f.module}.{f.qualname}": f for f in sources.library_functions(library)}
    assert set(found) == {"shapes.area", "shapes.decorated", "shapes.Square.perimeter", "pkg.version_tuple"}
    area = found["shapes.area"]
    assert area.prompt_code == 'def area(radius):\n    """The area of a circle of this radius, in square units."""\n'
    assert area.source.startswith(area.prompt_code) and area.source.endswith("return math.pi * squared\n")
    assert found["shapes.decorated"].prompt_code.startswith("@staticmethod\ndef decorated(a, b):")
    method = found["shapes.Square.perimeter"]
    assert method.owner == "Square" and method.source.startswith("def perimeter(self):")  # dedented
    # parsed in several processes (as the installed packages' thousands of files are): the same, in order
    assert sources.library_functions(library, workers=2) == sources.library_functions(library, workers=1)
    assert sources._parse_workers(sources.PARALLEL_FILES - 1, None) == 1


def test_python_function_records_are_chat_records(library, tmp_path):
    records = list(sources.python_function_records(seed=3, root=library))
    assert len(records) == 4 and len({r["id"] for r in records}) == 4
    assert records == list(sources.python_function_records(seed=3, root=library))  # the seed fixes the order
    by_id = {r["id"].split("/")[-1]: r for r in records}
    method = by_id["shapes.Square.perimeter"]["conversations"]
    assert "`perimeter` is a method of the class `Square` in the `shapes` module." in method[0]["value"]
    assert "def perimeter(self):" in method[0]["value"] and "return sides" not in method[0]["value"]
    reply = method[1]["value"]
    assert reply.startswith("```python\ndef perimeter(self):") and "return sides * self.side" in reply
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    read = list(chat_files.iter_records([path]))
    assert all(isinstance(r, chat_files.Record) for r in read)
    assert [[m["role"] for m in r.messages] for r in read] == [["user", "assistant"]] * 4


def test_the_standard_library_gives_thousands_of_code_prompts():
    functions = sources.library_functions()
    names = [f"{f.module}.{f.qualname}" for f in functions]
    assert len(functions) > 1000 and len(set(names)) > 0.95 * len(names)
    assert not any(".test." in f".{n}" or n.startswith("test.") for n in names)
    assert all(sources.MIN_LINES <= f.source.count("\n") <= sources.MAX_LINES for f in functions)


EQUATION = re.compile(r"(\$?\d+(?: [x+\-/] \$?\d+)+) = \$?(\d+)")


def test_word_problems_are_solved_right():
    """Every equation of every worked solution holds, the last result is the stated answer,
    a problem depends only on (seed, index), and every kind of problem occurs."""
    kinds = set()
    for index in range(3000):
        question, solution, answer = sources.word_problem(7, index)
        assert (question, solution, answer) == sources.word_problem(7, index)
        assert solution.endswith(f"The answer is {answer}.") and answer >= 0
        equations = EQUATION.findall(solution)
        assert equations, solution
        for left, right in equations:
            expression = left.replace("$", "").replace(" x ", " * ").replace(" / ", " // ")
            value = eval(expression)  # noqa: S307 - digits and operators only
            assert value == int(right), (question, solution)
            if " / " in left:
                a, b = (int(v) for v in left.replace("$", "").split(" / "))
                assert a % b == 0, solution
        kinds.add(question.split(" ")[1 if question.startswith("A ") else 2])
    assert sources.word_problem(7, 0) != sources.word_problem(8, 0)
    assert len({sources.word_problem(7, i)[0] for i in range(3000)}) > 2900
    assert len(kinds) >= 8


def test_data_source_writes_what_regeneration_takes(tmp_path):
    out = tmp_path / "wp.jsonl"
    argv = ["data", "source", "--source", "word-problems", "--limit", "25", "--seed", "2", "--out", str(out)]
    assert cli.main(argv) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 25 and not (tmp_path / "wp.jsonl.tmp").exists()
    first = json.loads(lines[0])
    assert first["id"] == "word-problems/2/0" and first["source"] == "word-problems"
    question, solution, _ = sources.word_problem(2, 0)
    assert first["conversations"] == [{"from": "human", "value": question}, {"from": "gpt", "value": solution}]
    assert all(isinstance(r, chat_files.Record) for r in chat_files.iter_records([out]))


def test_data_source_replaces_only_its_own_earlier_output(tmp_path, capsys):
    """A rerun (another --limit) replaces the source's own output; a file of other records (chats,
    the same prompts regenerated: other replies, another seed) is refused and kept as it was,
    unless --force; target-prompts, which resumes, takes no --force."""
    out = tmp_path / "wp.jsonl"
    run = lambda *extra: cli.main(["data", "source", "--source", "word-problems", "--out", str(out), *extra])  # noqa: E731
    assert run("--limit", "4") == 0 and run("--limit", "6") == 0 and run("--limit", "3") == 0
    assert out.read_text() == "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                       for r in itertools.islice(sources.word_problem_records(0), 3))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    records[2]["conversations"][1]["value"] = "the target's own reply"  # a regeneration of the same prompts
    regenerated = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    out.write_text(regenerated)
    capsys.readouterr()
    for extra, line in ((("--limit", "5"), 3), (("--limit", "3", "--seed", "1"), 1)):
        assert run(*extra) == 2
        assert f"its line {line} holds another record than" in capsys.readouterr().err
        assert out.read_text() == regenerated
    assert run("--limit", "3", "--force") == 0 and out.read_text() != regenerated
    assert cli.main(["data", "source", "--source", "target-prompts", "--target", "bundled:tiny-random-llama",
                     "--limit", "2", "--out", str(tmp_path / "own.jsonl"), "--force"]) == 2
    assert "--force: --source target-prompts resumes its own output" in capsys.readouterr().err
    assert not (tmp_path / "own.jsonl").exists()


def test_regeneration_answers_source_records(tmp_path, library):
    """The records go through `data regenerate` like any chat file: the reference reply is
    replaced by the target's, id and source are kept."""
    from dflash_train.data import regenerate

    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in sources.python_function_records(root=library)))
    out = tmp_path / "regen.jsonl"
    options = regenerate.RegenerationOptions(max_new_tokens=4, batch_size=2, device="cpu", temperature=5.0)
    regenerate.regenerate([path], "bundled:tiny-random-llama", out, options, log=lambda *_: None)
    before = [json.loads(line) for line in path.read_text().splitlines()]
    after = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["source"]) for r in after] == [(r["id"], r["source"]) for r in before]
    for old, new in zip(before, after):
        assert new["conversations"][0] == old["conversations"][0]
        assert new["conversations"][1]["value"] != old["conversations"][1]["value"]


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A package `fakepkg_dflash` 1.2.3 on sys.path (the LIBRARY files, with a dist-info), whose
    import would fail: python-packages must read it without importing it."""
    root = tmp_path / "site" / "fakepkg_dflash"
    for name, text in LIBRARY.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    (root / "__init__.py").write_text('raise RuntimeError("imported")\n\n\n' + textwrap.dedent('''
        def configure(level):
            """Set the package's level of detail for every later call."""
            previous = level
            return previous
        '''))
    info = tmp_path / "site" / "fakepkg_dflash-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakepkg-dflash\nVersion: 1.2.3\n")
    (info / "top_level.txt").write_text("fakepkg_dflash\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return root


def test_python_packages_reads_installed_packages_without_importing_them(installed, tmp_path):
    import sys

    assert sources.package_root("fakepkg_dflash") == installed and sources.package_version("fakepkg_dflash") == "1.2.3"
    records = list(sources.python_package_records(seed=1, packages=["fakepkg_dflash"]))
    ids = sorted(r["id"] for r in records)
    tag = "python-packages/fakepkg_dflash-1.2.3/fakepkg_dflash"
    assert ids == sorted(f"{tag}.{name}" for name in ("configure", "shapes.area", "shapes.decorated",
                                                      "shapes.Square.perimeter", "pkg.version_tuple"))
    assert "fakepkg_dflash" not in sys.modules
    assert all(r["source"] == "python-packages" for r in records)
    assert records == list(sources.python_package_records(seed=1, packages=["fakepkg_dflash"]))
    method = next(r for r in records if r["id"].endswith("Square.perimeter"))["conversations"][0]["value"]
    assert "`perimeter` is a method of the class `Square` in the `fakepkg_dflash.shapes` module." in method
    out = tmp_path / "pk.jsonl"
    argv = ["data", "source", "--source", "python-packages", "--packages", "fakepkg_dflash", "--limit", "3",
            "--seed", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == records[:3]


def test_python_packages_default_and_bad_package_lists(capsys, tmp_path):
    default = sources.installed_packages()
    assert {"torch", "transformers"} <= set(default) and set(default) <= set(sources.PACKAGES)
    with pytest.raises(sources.InputError, match=r"--packages: not installed here: no_such_pkg_here \("):
        sources.installed_packages(["torch", "no_such_pkg_here"])
    out = str(tmp_path / "x.jsonl")
    assert cli.main(["data", "source", "--source", "python-functions", "--packages", "torch", "--out", out]) == 2
    assert "--packages is an option of --source python-packages, not of python-functions" in capsys.readouterr().err
    assert cli.main(["data", "source", "--source", "python-packages", "--packages", " ,", "--out", out]) == 2
    assert "--packages names no package" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()
