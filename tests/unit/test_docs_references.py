"""docs/RELIABILITY.md cites the test that proves each behaviour, and the READMEs link to each other:
a test renamed or removed, or a file moved, leaves a citation no reader can follow. These tests read
the markdown itself, so such drift fails here.

A citation is a backticked `file.py::test_name` (or `tests/…/file.py::test_name`); `…::test_name`
names the previous file; a bare `test_name` lives in the file its table's header names
(`test_faults.py::`); `…` inside a name stands for any text, and a bracketed param id is not checked.
"""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO_ROOT

RELIABILITY = REPO_ROOT / "docs" / "RELIABILITY.md"
FILE = r"(?:tests/[\w/]+/)?test_\w+\.py"
NAME = r"test_[\w…]+"


def defined_tests_by_file(root=REPO_ROOT):
    """Maps each test file's path (relative to the root) to the test functions it defines."""
    return {
        str(path.relative_to(root)): {
            node.name
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
        }
        for path in (root / "tests").rglob("test_*.py")
    }


def cited_tests(markdown):
    """Yields (file, test name) for every test the markdown cites, resolving `…::` and table headers."""
    previous = table_file = None
    for line in markdown.splitlines():
        if line.startswith("## "):
            previous = table_file = None
        for span in re.findall(r"`([^`\n]+)`", line):
            if match := re.fullmatch(rf"({FILE})(::)?", span):
                previous = match.group(1)
                table_file = previous if match.group(2) else table_file
            elif match := re.fullmatch(rf"({FILE}|…)::({NAME})(\[.*\])?", span):
                previous = previous if match.group(1) == "…" else match.group(1)
                yield previous, match.group(2)
            elif (match := re.fullmatch(rf"({NAME})(\[.*\])?", span)) and table_file:
                yield table_file, match.group(1)


def missing_citations(markdown, tests):
    """The citations of the markdown that name no test of `tests` (see defined_tests_by_file)."""
    missing = []
    for cited_file, name in cited_tests(markdown):
        files = [path for path in tests if path == cited_file or path.endswith("/" + cited_file)]
        pattern = re.compile(re.escape(name).replace("…", ".*"))
        if not any(pattern.fullmatch(test) for path in files for test in tests[path]):
            missing.append(f"{cited_file}::{name}")
    return missing


def test_every_test_reliability_md_cites_exists():
    assert missing_citations(RELIABILITY.read_text(encoding="utf-8"), defined_tests_by_file()) == []


def test_a_citation_of_a_renamed_test_is_reported_missing():
    markdown = (
        "| case | test (`test_faults.py::`) |\n"
        "| a | `test_no_such_fault`, `test_io_formats.py::test_no_such_format`, `…::test_also_missing[x]` |\n"
    )
    assert missing_citations(markdown, defined_tests_by_file()) == [
        "test_faults.py::test_no_such_fault",
        "test_io_formats.py::test_no_such_format",
        "test_io_formats.py::test_also_missing",
    ]


def test_links_between_markdown_files_resolve():
    broken = []
    for markdown in REPO_ROOT.rglob("*.md"):
        if {".nox", ".git", "node_modules"} & set(markdown.parts):
            continue
        for link in re.findall(r"\]\(([^)\s]+)\)", markdown.read_text(encoding="utf-8")):
            target = link.split("#")[0]
            if target and not link.startswith(("http://", "https://", "mailto:")):
                if not (markdown.parent / target).exists():
                    broken.append(f"{markdown.relative_to(REPO_ROOT)}: {link}")
    assert broken == []
