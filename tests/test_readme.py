"""The README and the guides in docs/: the generated config reference is current, the README stays short
with the two commands at the top and links every guide, every relative link and repository path
resolves, and every documented `shardwise` command line parses."""

import glob
import re
import shlex
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIG_REFERENCE = DOCS / "config-reference.md"
README_MAX_LINES = 200  # one or two screens

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
REPO_DIRS = ("bench/", "configs/", "corpora/", "docs/", "scripts/", "tests/")
# Written elsewhere (scripts/claims.py; the architecture's own test): their links are checked, not their paths.
PATHS_NOT_CHECKED = ("ARCHITECTURE.md", "claims.md")


def documents() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(text: str) -> str:
    """The text without its fenced code blocks (a `# comment` there is not a heading, a link not a link)."""
    return FENCE.sub("", text)


def code_blocks(text: str, languages: tuple[str, ...]) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang in languages]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading).strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """Relative links of a Markdown file whose file (or heading anchor) does not exist."""
    problems = []
    for target in LINK.findall(prose(path.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{path.relative_to(ROOT)}: link to {target}: {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{path.relative_to(ROOT)}: link to {target}: no heading #{anchor} in "
                            f"{dest.relative_to(ROOT)} (headings: {sorted(anchors(dest))})")
    return problems


def missing_paths(path: Path) -> list[str]:
    """Repository paths written in `code spans` (bench/..., configs/..., ...) that match no file."""
    problems = []
    for span in CODE_SPAN.findall(path.read_text(encoding="utf-8")):
        words = span.split()
        name = words[0] if words else ""
        if name.startswith(REPO_DIRS) and not glob.glob(str(ROOT / name)):
            problems.append(f"{path.relative_to(ROOT)}: `{span}`: {name} does not exist")
    return problems


def shardwise_commands(text: str) -> list[list[str]]:
    """The argument lists of every `shardwise ...` command in the bash blocks of a Markdown text
    (also after torchrun's `-m shardwise.cli` or mpirun's options)."""
    commands = []
    for block in code_blocks(text, ("bash", "sh")):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            for i, word in enumerate(words):
                if word in ("shardwise", "shardwise.cli", ".venv/bin/shardwise"):
                    commands.append(words[i + 1:])
                    break
    return commands


def scripts_run(text: str) -> list[str]:
    """Repository scripts the bash blocks run (./scripts/demo, bench/....py)."""
    out = []
    for block in code_blocks(text, ("bash", "sh")):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            out += [w for w in words[:2] if w.startswith(("./scripts/", "scripts/", "bench/"))]
    return out


def test_config_reference_is_current():
    from shardwise.config import config_reference

    text = CONFIG_REFERENCE.read_text(encoding="utf-8")
    block = re.search(r"<!-- config-reference:start -->\n(.*)\n<!-- config-reference:end -->", text, re.S)
    assert block, "docs/config-reference.md lost its config-reference markers"
    assert block.group(1) == config_reference(), (
        "docs/config-reference.md is stale: replace the block between the markers with the output of "
        ".venv/bin/python -c 'from shardwise.config import config_reference; print(config_reference())'"
    )


def test_readme_gives_the_two_commands_at_the_top():
    text = README.read_text(encoding="utf-8")
    first_block = code_blocks(text, ("bash",))[0]
    assert "./scripts/demo" in first_block and "./scripts/test" in first_block, (
        "the README's first bash block must hold the two commands, ./scripts/demo and ./scripts/test"
    )
    assert text.index("./scripts/demo") < text.index("## Quick start"), "the two commands come before the quick starts"


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move the detail into a guide in docs/"
    )


def test_readme_has_the_quick_starts():
    headings = anchors(README)
    for part in ("pre-training", "fine-tuning", "several-devices"):
        assert any(h.startswith(f"quick-start-{part}") for h in headings), f"README lost its quick start for {part}"


def test_readme_links_every_guide():
    linked = {(README.parent / t.partition("#")[0]).resolve()
              for t in LINK.findall(prose(README.read_text(encoding="utf-8")))}
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not unlinked, f"README.md does not link these guides: {unlinked}"
    assert CONFIG_REFERENCE.resolve() in linked


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_paths_resolve(doc):
    problems = broken_links(doc) + ([] if doc.name in PATHS_NOT_CHECKED else missing_paths(doc))
    assert not problems, "\n".join(problems)


def test_documented_commands_parse():
    from shardwise.cli import build_parser

    parser = build_parser()
    checked, failures = 0, []
    for doc in documents():
        text = doc.read_text(encoding="utf-8")
        for argv in shardwise_commands(text):
            checked += 1
            try:
                parser.parse_args(argv)
            except SystemExit:
                failures.append(f"{doc.relative_to(ROOT)}: shardwise {shlex.join(argv)}")
        failures += [f"{doc.relative_to(ROOT)}: {s} does not exist" for s in scripts_run(text)
                     if not (ROOT / s).exists()]
    assert checked >= 20, f"found only {checked} documented shardwise commands: has the docs' format changed?"
    assert not failures, "documented commands that the CLI does not accept:\n" + "\n".join(failures)
