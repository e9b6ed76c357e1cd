"""The README and docs/ stay true: every `llmnpu` command they show parses with the CLI as it is,
every relative link names a file that exists, every `make` target they name exists, and the README
stays a front door (one screen to a running demo, depth in docs/)."""
import re
import shlex
from pathlib import Path

import pytest
from conftest import missing

from llmnpu_delegate.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _code_lines(text: str):
    """Lines of the fenced code blocks, with backslash continuations joined; diagrams are skipped."""
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        if "──" not in block:
            yield from block.replace("\\\n", " ").splitlines()


def _commands(page: Path, program: str = "llmnpu"):
    for line in _code_lines(page.read_text()):
        line = line.split(" #")[0].strip()
        m = re.match(rf"^(?:\S*/)?{program} (.*)$", line)
        if m:
            yield line, shlex.split(m.group(1))


def _links(page: Path):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if not re.match(r"(https?:|mailto:|#)", target):
            yield target.split("#")[0]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_shown_parses(page):
    parser = build_parser()
    for line, argv in _commands(page):
        try:
            parser.parse_args(argv)
        except SystemExit as e:       # argparse's way of refusing
            raise AssertionError(f"{page.name}: `{line}` does not parse (exit {e.code})") from None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_lm_eval_command_shown_parses(page):
    """`llmnpu-lm-eval` lines parse with lm_eval's own parser and name our model."""
    shown = list(_commands(page, "llmnpu-lm-eval"))
    if not shown:
        return
    HarnessCLI = pytest.importorskip("lm_eval._cli", reason=missing("lm-eval (the eval extra)")).HarnessCLI

    for line, argv in shown:
        try:
            args = HarnessCLI()._parser.parse_args(["run", *argv])
        except SystemExit as e:
            raise AssertionError(f"{page.name}: `{line}` does not parse (exit {e.code})") from None
        assert args.model == "llmnpu", line


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_names_a_file(page):
    missing = [t for t in _links(page) if t and not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to files that do not exist: {missing}"


def test_make_targets_named_exist():
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", makefile, flags=re.M))
    named = {t for page in PAGES for t in re.findall(r"`make ([a-z][a-z0-9-]*)", page.read_text())}
    assert named and named <= targets, f"not in the Makefile: {named - targets}"


def test_the_readme_is_a_front_door():
    text = (REPO / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move depth to docs/"
    head = "\n".join(lines[:60])
    assert "make demo" in head and "make test" in head          # the two commands, on the first screen
    assert "```python" in text
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test\n" in ci                                      # CI runs the README's test command
