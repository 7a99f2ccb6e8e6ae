import re
from pathlib import Path

from shardwise.config import config_reference

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_config_reference_is_current():
    text = README.read_text(encoding="utf-8")
    block = re.search(r"<!-- config-reference:start -->\n(.*)\n<!-- config-reference:end -->", text, re.S)
    assert block, "README lost its config-reference markers"
    assert block.group(1) == config_reference(), (
        "README's config reference is stale: replace the block between the markers with the output of "
        ".venv/bin/python -c 'from shardwise.config import config_reference; print(config_reference())'"
    )


def test_readme_gives_the_two_commands():
    text = README.read_text(encoding="utf-8")
    assert "./scripts/demo" in text and "./scripts/test" in text
