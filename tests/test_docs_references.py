"""What the documents name exists: relative links resolve, the architecture's module
table lists every jflash module, and every command-line flag the guides give is one
of the CLIs' flags (each CLI's own `--help`, read in process)."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = [
    "README.md",
    "BENCHMARKS.md",
    *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md")),
]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#+ (.*)$", re.M)
_FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(document: str, text: str) -> list[str]:
    """The relative links of `text` (a file of `document`'s directory, optionally with
    a `#heading`) whose file or heading does not exist."""
    broken = []
    for target in _LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (ROOT / document).parent / path if path else ROOT / document
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md":
            if anchor not in {_anchor(h) for h in _HEADING.findall(file.read_text())}:
                broken.append(target)
    return broken


def test_broken_links_are_found():
    assert broken_links("docs/testing.md", "[x](../README.md) [y](trainer.md#flags)") == []
    assert broken_links("docs/testing.md", "[x](../READ.md) [y](trainer.md#flagz)") == [
        "../READ.md",
        "trainer.md#flagz",
    ]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_relative_links_resolve(document):
    assert broken_links(document, (ROOT / document).read_text()) == []


def test_architecture_lists_every_jflash_module():
    table = (ROOT / "docs/architecture.md").read_text()
    modules = sorted(p.name for p in (ROOT / "jflash").glob("_*.py") if p.name != "__init__.py")
    assert [m for m in modules if f"`{m}`" not in table] == []


def _help(main, argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main(argv)
    return out.getvalue()


@pytest.fixture(scope="module")
def cli_helps() -> list[str]:
    """The `--help` of the trainer, its data and conversion commands and its tools."""
    from models import convert
    from train import config, data
    from train.tools import capacity, export, gradcheck, profile, trace

    texts = [
        config.build_parser().format_help(),
        _help(convert.main, ["--help"]),
        _help(capacity.main, ["--help"]),
        _help(capacity.main_plot, ["--help"]),
        _help(export.main, ["--help"]),
        _help(gradcheck.main, ["--help"]),
        _help(profile.main, ["--help"]),
        _help(trace.main, ["--help"]),
        *(_help(data.main, [c, "--help"]) for c in ("sample", "inspect", "cache", "tokenizer")),
    ]
    return texts


@pytest.fixture(scope="module")
def cli_flags(cli_helps) -> set[str]:
    """Every flag of those commands, and `python -m train.demo`'s `--keep`."""
    return {"--keep"} | {f for text in cli_helps for f in _FLAG.findall(text)}


def test_names_in_help_exist(cli_helps):
    """A `jflash.X`, `models.X` or `train.X` a `--help` points to can be imported."""
    import importlib

    missing = []
    for text in cli_helps:
        for name in set(re.findall(r"\b(?:jflash|models|train)(?:\.\w+)+", " ".join(text.split()))):
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                try:
                    found = importlib.import_module(".".join(parts[:i]))
                    break
                except ImportError:
                    continue
            for attribute in parts[i:]:
                found = getattr(found, attribute, None)
            if found is None:
                missing.append(name)
    assert missing == []


def test_trainer_help_lists_every_choice():
    from train import config

    helps = {a.dest: a.help for a in config.build_parser()._actions}
    unlisted = [
        f"--{name}: {choice}"
        for (section, name), allowed in config.CHOICES.items()
        for choice in allowed
        if choice is not None and str(choice) not in helps[f"{section}.{name}"]
    ]
    assert unlisted == []


# Flags of other programs the guides quote: XLA's, TensorBoard's, XProf's and pip's.
OTHER_PROGRAMS = re.compile(r"--xla_|--logdir|--port|--no-deps|--target$")


@pytest.mark.parametrize("document", ["README.md", "docs/trainer.md", "docs/profiling.md"])
def test_documented_flags_exist(document, cli_flags):
    text = (ROOT / document).read_text()
    # The benchmark scripts' flags are their own (each script's --help).
    text = text.split("## Kernel and ring benchmarks")[0]
    named = {f for f in _FLAG.findall(text) if not OTHER_PROGRAMS.match(f)}
    assert sorted(named - cli_flags) == []


def test_trainer_guide_names_every_config():
    guide = (ROOT / "docs/trainer.md").read_text()
    configs = sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert [c for c in configs if f"`{c}`" not in guide and f"configs/{c}" not in guide] == []


@pytest.mark.parametrize("document", ["docs/library.md", "docs/profiling.md", "BENCHMARKS.md"])
def test_documented_benchmark_flags_exist(document, cli_flags):
    """A flag the benchmark sections give is a tool's, or one a script in `benchmarks/`
    defines (read from the scripts' text: they need a GPU to import)."""
    sources = " ".join(p.read_text() for p in sorted((ROOT / "benchmarks").glob("*.py")))
    defined = set(re.findall(r"[\"'](--[a-z][\w-]*)[\"']", sources))
    text = (ROOT / document).read_text()
    named = {f for f in _FLAG.findall(text) if not OTHER_PROGRAMS.match(f)}
    assert sorted(named - cli_flags - defined) == []
