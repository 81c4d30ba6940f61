"""The repository speaks of the product as it is today, and keeps its layering.

How the code got here lives in git history and commit messages. The tracked files carry
no work-session ordinals or numbers, no issue numbers, no talk of machines being loaned,
and no citations of planning documents kept outside the repository; result files are
named by what and where (`kernel-h200.json`), not when.
"""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth"
)
_OUTSIDE_DOCS = "ANCHORS|STYLE|DESIGN"

# What a tracked file's text must not contain, each with the reason shown on failure.
TEXT_RULES = {
    "a work-session ordinal": re.compile(rf"\b({_ORDINALS})[- ]sessions?\b", re.IGNORECASE),
    "a work-session number": re.compile(r"\bsessions? #?[0-9]+\b", re.IGNORECASE),
    "an issue number": re.compile(r"\bissues? #?[0-9]+\b", re.IGNORECASE),
    "machines being loaned": re.compile(r"\b" + "le" + r"nt\b", re.IGNORECASE),
    "a document outside the repository": re.compile(rf"\b({_OUTSIDE_DOCS})\.md\b"),
}

# What a tracked file's path must not contain.
NAME_RULE = re.compile(rf"(^|[^a-z])(session|{_ORDINALS})([^a-z]|$)", re.IGNORECASE)

# Files that name the rules themselves.
SELF = {"tests/test_repository.py"}

# An import of a private jflash module: `import jflash._x`, `from jflash._x import ...`,
# `from jflash import _x`, or its name given to importlib.
PRIVATE_IMPORT = re.compile(
    r"^\s*(?:import\s+jflash\._|from\s+jflash\._|from\s+jflash\s+import\s+\(?\s*_)"
    r"|import_module\(\s*[\"']jflash\._",
    re.MULTILINE,
)
# Where code may use jflash's private modules: jflash itself, and its white-box tests.
PRIVATE_IMPORTERS = ("jflash/", "tests/")
# No exceptions: what a benchmark needs is on the facade.
PRIVATE_IMPORT_EXCEPTIONS: set[tuple[str, str]] = set()


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [path for path in out.split("\0") if path]


def text_of(path: str) -> str | None:
    """The file's text, or None for binary files (images, compressed data)."""
    try:
        data = (ROOT / path).read_bytes()
    except OSError:  # listed in the index but deleted in the work tree
        return None
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", errors="replace")


def history_words(text: str) -> list[str]:
    """`line N: reason: 'match'` for each line of `text` that breaks a text rule."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for reason, pattern in TEXT_RULES.items():
            for match in pattern.finditer(line):
                hits.append(f"line {number}: {reason}: {match.group(0)!r}")
    return hits


def test_rules_catch_history_words():
    # Spelled in two pieces, so this file does not hold the words it forbids.
    bad = [
        "as measured in the ninth " + "session",
        "the eleventh-" + "session runs",
        "see sess" + "ion 12",
        "fixes iss" + "ue 4",
        "iss" + "ues #7 and #8",
        "no 2-GPU machine was le" + "nt",
        "(ANC" + "HORS.md, kernel table)",
        "per DES" + "IGN.md",
        "STY" + "LE.md says so",
    ]
    for line in bad:
        assert history_words(line), line
    good = [
        "one session of the trainer",  # "session" alone is an ordinary word
        "the first call",
        "lenient tolerance",
        "a silent fallback",
        "the seed of the random inputs",
        "BENCHMARKS.md, README.md",
    ]
    for line in good:
        assert not history_words(line), line
    assert NAME_RULE.search("benchmarks/h200x2_session.sh")
    assert NAME_RULE.search("benchmarks/results/kernel-h100-ninth-run1.json")
    assert not NAME_RULE.search("benchmarks/results/kernel-h200.json")
    assert not NAME_RULE.search("benchmarks/multi_gpu.sh")


def test_tracked_text_has_no_history_words():
    failures = []
    for path in tracked_files():
        if path in SELF:
            continue
        text = text_of(path)
        if text is None:
            continue
        failures += [f"{path}: {hit}" for hit in history_words(text)]
    assert not failures, (
        "Say what is true today; how it got there belongs in commit messages:\n"
        + "\n".join(failures)
    )


def test_tracked_file_names_say_what_and_where():
    failures = [path for path in tracked_files() if NAME_RULE.search(path)]
    assert not failures, "Name files by what and where, not when:\n" + "\n".join(failures)


def test_private_import_rule():
    bad = [
        "from jflash." + "_ring import _Ring",
        "import jflash." + "_dispatch as dispatch",
        "    from jflash." + "_mask import Mask",
        "from jflash import " + "_layout",
        'importlib.import_module("jflash.' + '_ring")',
    ]
    for line in bad:
        assert PRIVATE_IMPORT.search(line), line
    good = ["import jflash", "from jflash import ring_attention, LAYOUTS", "# jflash's kernels"]
    for line in good:
        assert not PRIVATE_IMPORT.search(line), line


def test_nothing_outside_jflash_imports_its_private_modules():
    """models/, train/ and benchmarks/ use only the facade (`jflash/__init__.py`)."""
    failures = []
    for path in tracked_files():
        if not path.endswith(".py") or path.startswith(PRIVATE_IMPORTERS):
            continue
        text = text_of(path)
        for match in PRIVATE_IMPORT.finditer(text or ""):
            line = text.count("\n", 0, match.start()) + 1
            statement = text[match.start() :].split("\n", 1)[0].strip()
            if (path, statement) not in PRIVATE_IMPORT_EXCEPTIONS:
                failures.append(f"{path}:{line}: {statement}")
    assert not failures, "Import jflash's public API only:\n" + "\n".join(failures)


# `BENCHMARKS.md, "Heading"` or `BENCHMARKS.md "Heading"`, across a comment's line breaks.
BENCHMARKS_CITATION = re.compile(r'BENCHMARKS\.md,?\s+"([^"]+)"')


def cited_benchmarks_sections(text: str) -> list[str]:
    """The section titles `text` cites in BENCHMARKS.md (comment markers between lines
    dropped, so a citation wrapped in a `#` comment reads as one line)."""
    joined = re.sub(r"\n\s*(?:#+\s*)?", " ", text)
    return [" ".join(title.split()) for title in BENCHMARKS_CITATION.findall(joined)]


def test_citation_rule_reads_wrapped_comments():
    wrapped = 'see (BENCHMARKS.md,\n    # "Two GPUs, sequence\n# split").'
    assert cited_benchmarks_sections(wrapped) == ["Two GPUs, sequence split"]
    assert cited_benchmarks_sections('BENCHMARKS.md "Packed documents"') == ["Packed documents"]
    assert cited_benchmarks_sections("BENCHMARKS.md (0.908 at 8k)") == []


def test_cited_benchmarks_sections_exist():
    """A section that code or docs cite by its title is a heading of BENCHMARKS.md (the
    start of one: `"Two GPUs, sequence split"` names `Two GPUs, sequence split (seq=2)`)."""
    headings = [
        line.lstrip("#").strip().replace("`", "")
        for line in (ROOT / "BENCHMARKS.md").read_text().splitlines()
        if line.startswith("#")
    ]
    failures = []
    for path in tracked_files():
        if path in SELF or path.startswith("benchmarks/results/"):
            continue
        text = text_of(path)
        for title in cited_benchmarks_sections(text or ""):
            if not any(h.startswith(title.replace("`", "")) for h in headings):
                failures.append(f'{path}: "{title}"')
    assert not failures, "Cited sections missing from BENCHMARKS.md:\n" + "\n".join(failures)


def test_the_wheel_ships_every_package_and_the_example_configs():
    """`pyproject.toml` lists its packages by hand (configs/ is mapped into
    train/configs): every package folder is listed, every config is package data, and
    jflash's `py.typed` marker too."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        setup = tomllib.load(f)["tool"]["setuptools"]
    found = sorted(
        str(p.parent.relative_to(ROOT)).replace(os.sep, ".")
        for top in ("jflash", "models", "train")
        for p in (ROOT / top).rglob("__init__.py")
    )
    assert sorted(set(setup["packages"]) - {"train.configs"}) == found
    assert setup["package-dir"] == {"train.configs": "configs"}
    globs = setup["package-data"]["train.configs"]
    configs = sorted(p.name for p in (ROOT / "configs").iterdir())
    assert configs and all(any(fnmatch.fnmatch(n, g) for g in globs) for n in configs)
    # the PEP 561 marker: type checkers read jflash's annotations from an install
    assert (ROOT / "jflash" / "py.typed").is_file()
    assert setup["package-data"]["jflash"] == ["py.typed"]


def test_the_source_archive_holds_what_its_tests_need():
    """The sdist once held `tests/test_*.py` alone (setuptools' default), without their
    conftest, helpers, data or the benchmarks they check: 22 of its test files failed to
    import. `MANIFEST.in` takes every tracked file of tests/, benchmarks/, docs/ and
    configs/, and BENCHMARKS.md (its `graft` and `include` lines; this environment has
    no setuptools to build the archive with)."""
    rules = [
        line.split() for line in (ROOT / "MANIFEST.in").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]  # fmt: skip
    grafts = {words[1] for words in rules if words[0] == "graft"}
    includes = {name for words in rules if words[0] == "include" for name in words[1:]}
    tracked = subprocess.run(
        ["git", "ls-files", "tests", "benchmarks", "docs", "configs", "BENCHMARKS.md"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert "tests/conftest.py" in tracked
    left_out = [f for f in tracked if f not in includes and f.split("/")[0] not in grafts]
    assert left_out == [], left_out


def test_shipped_configs_are_found_in_a_clone_and_in_an_installed_package(tmp_path, monkeypatch):
    from train import config

    assert config.shipped_config("demo.yaml") == str(ROOT / "configs" / "demo.yaml")
    installed = tmp_path / "site-packages" / "train"
    (installed / "configs").mkdir(parents=True)
    (installed / "configs" / "demo.yaml").write_text("run: {max_steps: 1}\n")
    monkeypatch.setattr(config, "__file__", str(installed / "config.py"))
    assert config.shipped_config("demo.yaml") == str(installed / "configs" / "demo.yaml")
    # the docs' relative `--config configs/...` outside a clone reads the installed copy
    monkeypatch.chdir(tmp_path)
    assert config.config_file("configs/demo.yaml") == str(installed / "configs" / "demo.yaml")
    assert config.config_file("configs/other.yaml") == "configs/other.yaml"
    # another missing path is refused, naming the installed copy of that name
    with pytest.raises(ValueError, match=r"No such file or directory \(jflash's copy: --config "):
        config.load_yaml(str(tmp_path / "elsewhere" / "demo.yaml"))


# Modules whose distribution another declared one brings by design (jax pins its jaxlib).
_BROUGHT = {"jaxlib": "jax"}


def _declared_distributions() -> set[str]:
    """The distributions `pyproject.toml` names, in its dependencies or any extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        specs += extra
    names = {re.match(r"[A-Za-z0-9_.-]+", spec).group(0) for spec in specs}
    return {re.sub(r"[-_.]+", "-", name).lower() for name in names}


def test_every_package_the_code_imports_is_declared():
    """Each third-party module that `jflash`, `models` and `train` import (at the top or
    inside a function) comes from a distribution that `pyproject.toml` names, so an
    install from the wheel has it: `etils` was imported by the checkpoints and came only
    through orbax-checkpoint's own requirements."""
    import ast
    import importlib.metadata
    import sys

    declared = _declared_distributions()
    by_module = importlib.metadata.packages_distributions()
    ours = {"jflash", "models", "train"}
    missing = {}
    for package in sorted(ours):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top in ours or top in sys.stdlib_module_names or top == "__future__":
                        continue
                    # Not installed here (an extra's, e.g. wandb): its module's own name.
                    dists = by_module.get(top, [top]) if top not in _BROUGHT else [_BROUGHT[top]]
                    names = {re.sub(r"[-_.]+", "-", d).lower() for d in dists}
                    if not names & declared:
                        missing.setdefault(top, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
