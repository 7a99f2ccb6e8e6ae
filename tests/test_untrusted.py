"""shardwise.untrusted, the bounded readers of files from elsewhere, against independent references
(Python's json and PyYAML on the inputs they handle, the maths of nesting), and a user's config as the
first of those files: alias bombs, huge integers, deep nests, oversized files, devices and FIFOs end
as exit 2 naming the file, under a memory and time cap (tests/capped.py)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import yaml

from shardwise import untrusted
from shardwise.errors import CheckpointError, ConfigError
from tests.capped import CappedError, assert_refused, run_capped

# About 1 KB of YAML that expands to 9**9 (387 million) strings when walked.
ALIAS_BOMB = "\n".join(
    ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    + [f"{c}: &{c} [{','.join(['*' + p] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]
    + ["model: {preset: tiny_llama}", "train: {max_steps: 1, lr: *i}"]) + "\n"


def _json_refused(text: str | bytes, needle: str, **kwargs) -> None:
    with pytest.raises(CheckpointError) as e:
        untrusted.parse_json(text, "side.json", CheckpointError, **kwargs)
    assert str(e.value).startswith("side.json: ") and needle in str(e.value), str(e.value)


# --- JSON ----------------------------------------------------------------------------------------------


def test_json_within_bounds_is_what_json_gives() -> None:
    """Random documents within the bounds parse exactly as json.loads parses them."""
    rng = random.Random(3)

    def value(depth: int):  # noqa: ANN202
        kind = rng.randrange(6 if depth < 8 else 4)
        if kind == 0:
            return rng.randrange(-10**30, 10**30)
        if kind == 1:
            return rng.random() * 10 ** rng.randrange(-5, 5)
        if kind == 2:
            return "".join(rng.choice('ab"\\[]{}é\n') for _ in range(rng.randrange(8)))
        if kind == 3:
            return rng.choice([None, True, False])
        if kind == 4:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        return {f"k{i}": value(depth + 1) for i in range(rng.randrange(4))}

    for _ in range(300):
        text = json.dumps(value(0))
        assert untrusted.parse_json(text, "f", CheckpointError) == json.loads(text)


def test_nesting_depth_is_the_deepest_bracket_outside_strings() -> None:
    assert untrusted.nesting_depth('{"a": [[1], {"b": []}]}') == 4
    assert untrusted.nesting_depth('["[[[[", "\\"[[["]') == 1  # brackets inside strings, an escaped quote
    assert untrusted.nesting_depth("42") == 0
    depth = untrusted.MAX_DEPTH
    assert untrusted.parse_json("[" * depth + "]" * depth, "f", CheckpointError) is not None
    _json_refused("[" * (depth + 1) + "]" * (depth + 1), f"nests {depth + 1} levels deep")
    _json_refused('{"a":' * 100_000 + "1" + "}" * 100_000, "levels deep")  # no RecursionError


def test_json_refuses_what_no_side_file_holds() -> None:
    _json_refused("1" + "0" * untrusted.MAX_INT_DIGITS, f"integer of {untrusted.MAX_INT_DIGITS + 1} digits")
    _json_refused("-" + "9" * 5000, "integer of 5,000 digits")
    _json_refused('{"loss": NaN}', "holds NaN")
    _json_refused("[Infinity]", "holds Infinity")
    assert untrusted.parse_json('{"loss": NaN}', "f", CheckpointError, allow_nonfinite=True)["loss"] != 0
    _json_refused(b'{"a": "\xff"}', "byte 7 is not UTF-8")
    _json_refused('{"a": 1', "is not valid JSON")
    _json_refused("", "is not valid JSON")


def test_files_are_capped_before_they_are_read(tmp_path: Path) -> None:
    big = tmp_path / "config.json"
    big.write_bytes(b" " * 2000)
    with pytest.raises(CheckpointError, match="is 2,000 bytes, more than the 1,000"):
        untrusted.read_json(big, CheckpointError, limit=1000)
    for special in ("/dev/zero", "/dev/urandom"):
        link = tmp_path / f"{Path(special).name}.json"
        link.symlink_to(special)
        with pytest.raises(CheckpointError, match="is not a regular file"):
            untrusted.read_json(link, CheckpointError)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # opening it to read would block until a writer comes: it is never opened
    with pytest.raises(CheckpointError, match="is not a regular file"):
        untrusted.read_bytes(fifo, CheckpointError)
    with pytest.raises(CheckpointError, match="cannot be read"):
        untrusted.read_bytes(tmp_path / "missing.json", CheckpointError)
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(CheckpointError, match="holds a list, not a JSON object"):
        untrusted.read_json_object(tmp_path / "list.json", CheckpointError)


# --- fields --------------------------------------------------------------------------------------------


def test_fields_are_typed_and_ranged() -> None:
    doc = {"heads": 8, "float_heads": 8.0, "flag": True, "zero": 0, "big": 10**20, "name": "q_proj",
           "nan": float("nan"), "alpha": 16, "text": "x" * 2000}
    assert untrusted.int_field(doc, "heads", "c.json", CheckpointError, lo=1) == 8
    assert untrusted.int_field(doc, "float_heads", "c.json", CheckpointError, lo=1) == 8
    assert untrusted.int_field(doc, "absent", "c.json", CheckpointError, default=None) is None
    assert untrusted.number_field(doc, "alpha", "c.json", CheckpointError, lo=0) == 16.0
    assert untrusted.str_field(doc, "name", "c.json", CheckpointError) == "q_proj"
    assert untrusted.bool_field(doc, "flag", "c.json", CheckpointError) is True
    for call, needle in [
        (lambda: untrusted.int_field(doc, "zero", "c.json", CheckpointError, lo=1), "'zero' is 0, outside 1.."),
        (lambda: untrusted.int_field(doc, "flag", "c.json", CheckpointError), "'flag' is a boolean"),
        (lambda: untrusted.int_field(doc, "big", "c.json", CheckpointError), "outside 0.."),
        (lambda: untrusted.int_field(doc, "name", "c.json", CheckpointError), "'name' is a string ('q_proj')"),
        (lambda: untrusted.int_field(doc, "absent", "c.json", CheckpointError), "has no 'absent'"),
        (lambda: untrusted.number_field(doc, "nan", "c.json", CheckpointError), "'nan' is nan"),
        (lambda: untrusted.str_field(doc, "text", "c.json", CheckpointError), "2,000 characters long"),
        (lambda: untrusted.bool_field(doc, "heads", "c.json", CheckpointError), "not true or false"),
    ]:
        with pytest.raises(CheckpointError) as e:
            call()
        assert str(e.value).startswith("c.json: ") and needle in str(e.value), str(e.value)


def test_ascii_digits_refuse_the_digits_python_also_reads() -> None:
    assert untrusted.ascii_digits("12")
    for text in ("", "١٢", "²", "1٢", "12 ", "-1"):
        assert not untrusted.ascii_digits(text), text
    assert int("١٢") == 12  # what makes the check necessary: int() takes Arabic-Indic digits


# --- regular expressions -------------------------------------------------------------------------------


def test_a_backtracking_pattern_stops_within_its_bound() -> None:
    pattern = untrusted.compile_pattern(r"(a|aa)+$", "adapter_config.json", CheckpointError)
    assert untrusted.bounded_fullmatch(pattern, "aaaa", "adapter_config.json", CheckpointError)
    with pytest.raises(CheckpointError, match="took more than 0.2 s to match"):
        untrusted.bounded_fullmatch(pattern, "a" * 40 + "!", "adapter_config.json", CheckpointError, seconds=0.2)
    with pytest.raises(CheckpointError, match="is not a regular expression"):
        untrusted.compile_pattern("(unclosed", "adapter_config.json", CheckpointError)
    with pytest.raises(CheckpointError, match="more than 1,000"):
        untrusted.compile_pattern("a" * 1001, "adapter_config.json", CheckpointError)


# --- YAML ----------------------------------------------------------------------------------------------


def test_yaml_within_bounds_is_what_pyyaml_gives() -> None:
    text = "model: {preset: tiny_llama, hidden_size: 64}\ntrain:\n  lr: 1.0e-3\n  files: [a, b]\n  x: null\n"
    assert untrusted.parse_yaml(text, "c.yaml", ConfigError) == yaml.safe_load(text)


@pytest.mark.parametrize("text, needle", [
    (ALIAS_BOMB, "found the alias *a: aliases"),
    ("base: &b {lr: 1}\ntrain:\n  <<: *b\n", "found the alias *b"),
    ("train: {max_steps: " + "9" * 5000 + "}\n", "integer of 5,000 digits"),
    ("train: " + "[" * 200 + "]" * 200 + "\n", "nests more than 100 levels deep"),
    ("a: !!python/object/apply:os.system ['true']\n", "could not determine a constructor"),
    ("train: {lr: 1}\ntrain: {lr: 2}\n", "found key 'train' a second time"),
])
def test_yaml_refusals(text: str, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        untrusted.parse_yaml(text, "c.yaml", ConfigError)
    assert str(e.value).startswith("c.yaml: is not valid YAML") and needle in str(e.value), str(e.value)


def _walk_bomb() -> int:
    """What reading the bomb the old way costs: PyYAML shares the aliased lists, and the first walk
    over the tree (as translating and validating a config does) visits every one of them."""
    def count(x) -> int:  # noqa: ANN001
        return sum(count(v) for v in x) if isinstance(x, list) else 1
    return count(yaml.safe_load(ALIAS_BOMB)["i"])


def test_the_cap_catches_the_bomb_unbounded_reading_walks_into() -> None:
    """The harness bites: the bomb read without the bound runs past a 3 s cap."""
    with pytest.raises(CappedError, match="took more than 3 s"):
        run_capped(_walk_bomb, memory_mib=512, seconds=3)


def test_hostile_configs_end_as_exit_2(tmp_path: Path) -> None:
    """A user's config (and so a run's or checkpoint's config.yaml, which the same reader reads): exit 2
    naming the file, within 512 MiB and 30 s each."""
    cases = {
        "bomb.yaml": ALIAS_BOMB,
        "digits.yaml": "model: {preset: tiny_llama}\ntrain: {max_steps: " + "7" * 20000 + "}\n",
        "nested.yaml": "model: {preset: tiny_llama}\ntrain: {x: " + "[" * 5000 + "]" * 5000 + "}\n",
    }
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        assert_refused(["train", tmp_path / name, "--dry-run"], str(tmp_path / name), memory_mib=512, seconds=30)
    huge = tmp_path / "huge.yaml"
    with open(huge, "wb") as f:
        f.truncate(17 << 20)  # sparse: 17 MiB of NUL without writing them
    assert_refused(["train", huge, "--dry-run"], str(huge), "more than the", memory_mib=512, seconds=30)
    good = tmp_path / "good.yaml"
    good.write_text("model: {preset: tiny_llama}\ntrain: {max_steps: 1}\n")
    assert_refused(["train", good, "--dry-run", "--set", "train.lr=*x"], "--set 'train.lr=*x'", "alias",
                   memory_mib=512, seconds=30)
