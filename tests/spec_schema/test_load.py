"""Unit tests of the YAML loader (``mpgen.spec_schema.load``) and error helpers."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from mpgen.errors import MAX_SHOWN, Collector, ErrorList, MpgenError, Position, did_you_mean
from mpgen.spec_schema.load import MAX_BYTES, MAX_DEPTH, load_file, load_text

SPEC = textwrap.dedent("""\
    mpgen: 1
    name: SimpleModel
    inputs:
      x: [batch, 10]
    layers:
      layer1: {op: Linear, args: [10, 20]}
      layer2:
        op: Linear
        args:
          - 20
          - 10
    train:
      optimizer: {op: AdamW, lr: 3e-4}
    """)


def load(text: str):
    return load_text(textwrap.dedent(text), "spec.yaml")


def error_of(text: str) -> str:
    with pytest.raises(MpgenError) as info:
        load(text)
    return str(info.value)


# --------------------------------------------------------------------------
# data and positions


def test_data_is_plain_python():
    data = load_text(SPEC, "spec.yaml").data
    assert data == {
        "mpgen": 1, "name": "SimpleModel", "inputs": {"x": ["batch", 10]},
        "layers": {"layer1": {"op": "Linear", "args": [10, 20]},
                   "layer2": {"op": "Linear", "args": [20, 10]}},
        "train": {"optimizer": {"op": "AdamW", "lr": 3e-4}},
    }
    assert list(data) == ["mpgen", "name", "inputs", "layers", "train"]  # order kept


@pytest.mark.parametrize("path, key, value", [
    (("mpgen",), (1, 1), (1, 8)),
    (("inputs", "x"), (4, 3), (4, 6)),
    (("layers", "layer1"), (6, 3), (6, 11)),
    (("layers", "layer1", "op"), (6, 12), (6, 16)),
    (("layers", "layer1", "args"), (6, 24), (6, 30)),
    (("layers", "layer2", "op"), (8, 5), (8, 9)),
    (("train", "optimizer", "lr"), (13, 26), (13, 30)),
])
def test_positions_of_keys_and_values(path, key, value):
    source = load_text(SPEC, "spec.yaml").source
    assert source.key(path) == Position("spec.yaml", *key)
    assert source.value(path) == Position("spec.yaml", *value)


def test_positions_of_list_items():
    source = load_text(SPEC, "spec.yaml").source
    assert source.value(("inputs", "x", 0)) == Position("spec.yaml", 4, 7)
    assert source.value(("inputs", "x", 1)) == Position("spec.yaml", 4, 14)
    assert source.value(("layers", "layer2", "args", 1)) == Position("spec.yaml", 11, 9)


def test_missing_paths_fall_back_to_the_nearest_ancestor():
    source = load_text(SPEC, "spec.yaml").source
    assert source.value(("layers", "layer1", "in")) == source.value(("layers", "layer1"))
    assert source.key(("layers", "layer1", "in")) == source.value(("layers", "layer1"))
    assert source.value(("nothing", "here")) == Position("spec.yaml", 1, 1)


def test_positions_count_characters_not_bytes():
    source = load("""\
        name: Modèle
        layers: {é: 1, b: 2}
        """).source
    assert source.key(("layers", "b")) == Position("spec.yaml", 2, 16)


def test_a_byte_order_mark_is_accepted():
    assert load_text("\ufeffmpgen: 1\n", "spec.yaml").data == {"mpgen": 1}


def test_crlf_line_ends_keep_positions():
    source = load_text("a: 1\r\nb: {c: 2}\r\n", "spec.yaml").source
    assert source.value(("b", "c")) == Position("spec.yaml", 2, 8)


# --------------------------------------------------------------------------
# scalars: YAML 1.2 numbers, YAML 1.1 booleans


@pytest.mark.parametrize("text, value", [
    ("3e-4", 3e-4), ("3.0e-4", 3e-4), ("1e3", 1000.0), ("-2.5E+2", -250.0), (".5", 0.5),
    ("-.5e1", -5.0), ("2.", 2.0), ("1_000.5", 1000.5), (".inf", float("inf")),
    ("-.inf", float("-inf")),
    ("0", 0), ("-2", -2), ("+3", 3), ("1_000", 1000), ("0x1F", 31), ("0o17", 15),
    ("0b101", 5),
    ("true", True), ("False", False), ("yes", True), ("no", False), ("on", True),
    ("off", False),
    ("~", None), ("null", None), ("", None),
    ("010", "010"), ("1:30", "1:30"), ("1e", "1e"), ("e3", "e3"), ("cuda:0", "cuda:0"),
    ("h.0-5", "h.0-5"), ("'3e-4'", "3e-4"), ('"1"', "1"), ("!!str 12", "12"),
])
def test_scalar_types(text, value):
    assert load_text(f"v: {text}\n", "spec.yaml").data["v"] == value
    assert type(load_text(f"v: {text}\n", "spec.yaml").data["v"]) is type(value)


def test_nan_is_a_float():
    value = load_text("v: .nan\n", "spec.yaml").data["v"]
    assert isinstance(value, float) and value != value


def test_keys_are_the_text_written():
    data = load("""\
        1: a
        true: b
        ~: c
        "quoted": d
        3e-4: e
        """).data
    assert list(data) == ["1", "true", "~", "quoted", "3e-4"]


def test_the_loader_does_not_change_pyyaml_for_others():
    assert yaml.safe_load("v: 3e-4") == {"v": "3e-4"}  # PyYAML's own YAML 1.1 reading
    assert yaml.safe_load("v: 1:30") == {"v": 90}


# --------------------------------------------------------------------------
# refusals


def test_duplicate_keys_are_all_reported():
    message = error_of("""\
        name: A
        layers:
          a: {op: ReLU, inplace: true, inplace: false}
          a: {op: ReLU}
        name: B
        """)
    assert message.splitlines() == [
        "spec.yaml:3:32: duplicate key 'inplace' (first defined at line 3, column 17)",
        "spec.yaml:4:3: duplicate key 'a' (first defined at line 3, column 3)",
        "spec.yaml:5:1: duplicate key 'name' (first defined at line 1, column 1)",
    ]


def test_duplicate_keys_spelled_differently():
    message = error_of("""\
        a: 1
        "a": 2
        """)
    assert message == "spec.yaml:2:1: duplicate key 'a' (first defined at line 1, column 1)"


def test_anchors_and_aliases_are_refused():
    assert error_of("a: &x 1\nb: *x\n") == (
        "spec.yaml:1:4: YAML anchors (&x) are not allowed in a spec; write the value out")
    assert error_of("a: *x\n") == (
        "spec.yaml:1:4: YAML aliases (*x) are not allowed in a spec; write the value out")
    assert error_of("&k a: 1\n").startswith("spec.yaml:1:1: YAML anchors (&k)")


def test_billion_laughs_is_refused_at_the_first_anchor():
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [{','.join([f'*a{i-1}'] * 9)}]" for i in range(1, 10)]
    message = error_of("\n".join(lines))
    assert message.startswith("spec.yaml:1:5: YAML anchors (&a0) are not allowed")


def test_merge_keys_are_refused():
    assert error_of("a: {<<: {b: 1}, c: 2}\n") == (
        "spec.yaml:1:5: YAML merge keys (<<) are not allowed in a spec; write the keys out")


@pytest.mark.parametrize("text, message", [
    ("v: !!python/object/apply:os.system [id]\n",
     "spec.yaml:1:4: YAML tag '!!python/object/apply:os.system' is not allowed in a spec"),
    ("v: !custom 1\n", "spec.yaml:1:4: YAML tag '!custom' is not allowed in a spec"),
    ("v: !!binary aGk=\n", "spec.yaml:1:4: YAML tag '!!binary' is not allowed in a spec"),
    ("v: !!set {a}\n", "spec.yaml:1:4: YAML tag '!!set' is not allowed in a spec"),
    ("v: !!str [1]\n", "spec.yaml:1:4: YAML tag '!!str' is not allowed in a spec"),
    ("!!python/name:os.system v: 1\n",
     "spec.yaml:1:1: YAML tag '!!python/name:os.system' is not allowed in a spec"),
    ("v: !!float x\n", "spec.yaml:1:4: 'x' is not a valid !!float value"),
    ("v: !!bool maybe\n", "spec.yaml:1:4: 'maybe' is not a valid !!bool value"),
    ("v: 2024-01-31\n", "spec.yaml:1:4: '2024-01-31' reads as a date in YAML; quote it "
                        "('2024-01-31') to make it a string"),
])
def test_tags_and_non_standard_types_are_refused(text, message):
    assert error_of(text) == message


def test_mapping_keys_must_be_scalars():
    assert error_of("? [a, b]\n: 1\n") == (
        "spec.yaml:1:3: mapping keys must be plain names, not lists or mappings")


def test_nesting_limit_is_exact():
    ok = "v: " + "[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1) + "\n"
    assert load_text(ok, "spec.yaml").data["v"] is not None
    too_deep = "v: " + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "\n"
    with pytest.raises(MpgenError) as info:
        load_text(too_deep, "spec.yaml")
    assert str(info.value) == (
        f"spec.yaml:1:{3 + MAX_DEPTH}: spec is nested deeper than {MAX_DEPTH} levels")


@pytest.mark.parametrize("text", [
    "v: " + "[" * 200_000,
    "v: " + "{a: " * 100_000,
    "".join("  " * i + "a:\n" for i in range(500)),
    "- " * 100_000,
])
def test_deep_nesting_never_overflows_the_stack(text):
    with pytest.raises(MpgenError) as info:
        load_text(text, "spec.yaml")
    assert "nested deeper than" in str(info.value) or "larger than" in str(info.value)


def test_size_limit(tmp_path):
    text = "a: 1\n#" + "x" * MAX_BYTES
    with pytest.raises(MpgenError, match=f"spec.yaml:1:1: spec is larger than {MAX_BYTES} bytes"):
        load_text(text, "spec.yaml")
    path = tmp_path / "big.yaml"
    path.write_text(text)
    with pytest.raises(MpgenError, match=f"big.yaml:1:1: spec is larger than {MAX_BYTES}"):
        load_file(path)
    path.write_text("a: 1\n#" + "x" * (MAX_BYTES - 10))
    assert load_file(path).data == {"a": 1}


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n", "~\n"])
def test_empty_specs(text):
    assert error_of(text) == "spec.yaml:1:1: spec is empty"


def test_not_utf8_points_at_the_byte(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"mpgen: 1\nname: Mod\xe8le\n")
    with pytest.raises(MpgenError) as info:
        load_file(path)
    assert str(info.value) == (
        f"{path}:2:10: spec is not UTF-8: byte 0xe8 here is not valid UTF-8 "
        "(invalid continuation byte); save the file as UTF-8")


def test_control_characters_point_at_the_character():
    assert error_of("a: 1\nb: x\x00y\n") == "spec.yaml:2:5: invalid character U+0000 in the spec"


def test_missing_file(tmp_path):
    with pytest.raises(MpgenError) as info:
        load_file(tmp_path / "nope.yaml")
    missing = tmp_path / "nope.yaml"
    assert str(info.value) == f"{missing}: cannot read spec: No such file or directory"


@pytest.mark.parametrize("text, message", [
    ("a: {b: 1\n", "spec.yaml:1:4: invalid YAML: this '{' is never closed (expected '}')"),
    ("a: [1, 2\nb: 3\n", "spec.yaml:1:4: invalid YAML: this '[' is not closed: expected ',' "
                         "or ']' before line 2, column 2"),
    ("a: 'x\n", "spec.yaml:1:4: invalid YAML: this quoted string is never closed"),
    ("a:\n\tb: 1\n", "spec.yaml:2:1: invalid YAML: tab character; indent YAML with spaces, "
                     "and separate values with spaces"),
    ("a: 1\n---\nb: 2\n", "spec.yaml:2:1: invalid YAML: a spec is one YAML document, but a "
                          "second one starts here"),
    ("a: b: c\n", "spec.yaml:1:5: invalid YAML: unexpected ':' (check the indentation of this "
                  "line, or quote a value that contains ': ')"),
    ("a: 1\nb\n", "spec.yaml:2:1: invalid YAML: expected 'key: value', but this line has no ':'"),
    ("a:\n  b: 1\n c: 2\n", "spec.yaml:3:2: invalid YAML: this line does not fit the structure "
                            "above it (check its indentation and the brackets before it)"),
    ("a: @x\n", "spec.yaml:1:4: invalid YAML: found character '@' that cannot start any token; "
                "put the value in quotes"),
])
def test_yaml_syntax_errors_in_plain_words(text, message):
    assert error_of(text) == message


def test_errors_of_one_file_are_reported_together_in_file_order():
    message = error_of("""\
        a: !x 1
        b: {c: 1, c: 2}
        d: !!python/none ''
        """)
    assert [line.split(": ")[0] for line in message.splitlines()] == [
        "spec.yaml:1:4", "spec.yaml:2:11", "spec.yaml:3:4"]


# --------------------------------------------------------------------------
# error helpers


def test_error_list_sorts_dedupes_and_caps():
    errors = [MpgenError(Position("f", line, 1), f"e{line}") for line in range(300, 0, -1)]
    errors.append(MpgenError(Position("f", 5, 1), "e5"))
    report = str(ErrorList(errors))
    lines = report.splitlines()
    assert lines[:3] == ["f:1:1: e1", "f:2:1: e2", "f:3:1: e3"]
    assert len(lines) == MAX_SHOWN + 1
    assert lines[-1] == f"... and {300 - MAX_SHOWN} more errors"


def test_collector_raises_one_error_or_a_list():
    one = Collector()
    one.add(Position("f", 1, 2), "bad")
    with pytest.raises(MpgenError) as info:
        one.raise_if_any()
    assert not isinstance(info.value, ErrorList) and str(info.value) == "f:1:2: bad"
    Collector().raise_if_any()  # nothing to report


@pytest.mark.parametrize("word, candidates, hint", [
    ("Relu", ["F.elu", "ReLU", "ReLU6"], " (did you mean 'ReLU'?)"),
    ("adamw", ["Adam", "AdamW"], " (did you mean 'AdamW'?)"),
    ("Linaer", ["Linear", "Bilinear"], " (did you mean 'Linear'?)"),
    ("zzz", ["Linear"], ""),
    ("x", [], ""),
])
def test_did_you_mean(word, candidates, hint):
    assert did_you_mean(word, candidates) == hint
