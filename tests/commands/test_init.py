"""``mpgen init [NAME]``: the starter spec builds, trains and passes its own tests."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import mpgen
from mpgen.compiler.driver import compile_spec

NEXT = re.compile(r"^  (\S.*?)  +# ", re.M)


# Slow: builds, trains and runs the generated tests in subprocesses
@pytest.mark.slow
def test_init_writes_a_starter_that_builds_and_trains(tmp_path):
    ran = mpgen("init", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0] == "wrote model.yaml: the Model starter spec; next:"
    commands = NEXT.findall(ran.stdout)
    assert commands == ["mpgen build model.yaml --device-map cpu",
                        "python generated/train_model.py --steps 10",
                        "python -m pytest -q generated",
                        "mpgen check model.yaml --device-map cpu"]

    # The tutorial's model: Linear(10, 10) on cuda:0, ReLU, Linear(10, 5) on cuda:1.
    graph = compile_spec(tmp_path / "model.yaml")
    assert [(n.name, n.op.spelled, n.devices, n.params) for n in graph.nodes] == [
        ("net1", "Linear", ("cuda:0",), 110),
        ("relu", "ReLU", ("cuda:0",), 0),
        ("net2", "Linear", ("cuda:1",), 55),
    ]

    # The commands it prints, in order, as a user runs them.
    assert mpgen(*commands[0].split()[1:], cwd=tmp_path).returncode == 0
    train = subprocess.run([sys.executable, *commands[1].split()[1:]],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr
    assert "Model: 165 parameters; 10 steps of 20 samples" in train.stdout
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "generated"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=600)
    assert tests.returncode == 0, tests.stdout
    check = mpgen(*commands[3].split()[1:], cwd=tmp_path)
    assert (check.returncode, check.stdout) == (0, "generated: up to date\n")


def test_the_starters_commented_alternative_placement_builds(tmp_path):
    assert mpgen("init", cwd=tmp_path).returncode == 0
    text = (tmp_path / "model.yaml").read_text()
    explicit = "placement:\n  net1: cuda:0\n  net2: cuda:1\n"
    auto = re.search(r"^# (placement:\n)# (  auto: .*\n)", text, re.M)
    (tmp_path / "model.yaml").write_text(text.replace(explicit, auto[1] + auto[2]))
    devices = [n.devices for n in compile_spec(tmp_path / "model.yaml").nodes]
    assert devices == [("cuda:0",), ("cuda:0",), ("cuda:1",)]


@pytest.mark.parametrize("name, path, class_name", [
    ("my_net", "my_net.yaml", "MyNet"),
    ("specs/gpt-small.yml", "specs/gpt-small.yml", "GptSmall"),
    ("Encoder", "Encoder.yaml", "Encoder"),
])
def test_init_names_the_file_and_the_class(tmp_path, name, path, class_name):
    (tmp_path / "specs").mkdir()
    ran = mpgen("init", name, cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith(f"wrote {path}: the {class_name} starter spec")
    assert f"\nname: {class_name}\n" in (tmp_path / path).read_text()
    assert compile_spec(tmp_path / path).name == class_name


def test_init_never_overwrites(tmp_path):
    (tmp_path / "model.yaml").write_text("mine\n")
    (tmp_path / "dangling.yaml").symlink_to(tmp_path / "nowhere.yaml")
    for name, shown in (("model", "model.yaml"), ("dangling", "dangling.yaml")):
        ran = mpgen("init", name, cwd=tmp_path)
        assert ran.returncode == 2 and ran.stdout == ""
        assert ran.stderr == (f"{shown}: already exists; refusing to overwrite it (move it "
                              "away, or name another file: mpgen init NAME)\n")
    assert (tmp_path / "model.yaml").read_text() == "mine\n"
    assert not (tmp_path / "nowhere.yaml").exists()


@pytest.mark.parametrize("name, why", [
    ("torch", "'Torch' would generate torch.py, which shadows the module 'torch' the "
              "generated code imports; choose another name (e.g. 'TorchModel')"),
    ("2d", "'2d' is not a valid Python identifier"),
    ("none", "'None'"),
])
def test_init_refuses_a_name_no_model_can_have(tmp_path, name, why):
    ran = mpgen("init", name, cwd=tmp_path)
    assert ran.returncode == 2 and ran.stdout == ""
    assert ran.stderr.startswith(f"mpgen init {name}: cannot name a model after '{name}.yaml': ")
    assert why in ran.stderr
    assert list(tmp_path.iterdir()) == []


def test_init_into_a_missing_folder_is_a_clean_error(tmp_path):
    ran = mpgen("init", "no/such/model", cwd=tmp_path)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert ran.stderr.startswith("mpgen: ") and "no/such/model.yaml" in ran.stderr
