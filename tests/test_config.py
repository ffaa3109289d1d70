"""`[tool.mpgen]` in pyproject.toml: what `build` and `check` use for what the
command line leaves out; its mistakes at their line and column."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import EXAMPLES, listing, mpgen
from test_files_safety import GATE, GATED  # a spec using mylayers.Gate, a user module

SEED = EXAMPLES / "seed.yaml"


def project(tmp_path: Path, config: str) -> Path:
    """A project holding the seed spec under specs/ and ``config`` as its
    pyproject.toml."""
    (tmp_path / "pyproject.toml").write_text(config)
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "seed.yaml").write_text(SEED.read_text())
    return tmp_path


CONFIG = '[project]\nname = "demo"\n\n[tool.mpgen]\nspecs = ["specs/*.yaml"]\nout = "gen"\n'


def test_build_and_check_without_arguments_use_the_config(tmp_path):
    root = project(tmp_path, CONFIG + 'device-map = "cpu"\n')
    build = mpgen("build", cwd=root)
    assert build.returncode == 0, build.stderr
    assert build.stdout.splitlines()[0] == "wrote gen/simple_model.py"
    assert "# devices remapped at build time: --device-map *=cpu" in (
        root / "gen" / "simple_model.py").read_text()
    check = mpgen("check", cwd=root)
    assert (check.returncode, check.stdout) == (0, "gen: up to date\n")


def test_the_config_is_found_from_a_subfolder_and_its_paths_are_its_folder_s(tmp_path):
    root = project(tmp_path, CONFIG)
    (root / "docs").mkdir()
    build = mpgen("build", cwd=root / "docs")
    assert build.returncode == 0, build.stderr
    assert build.stdout.splitlines()[0] == "wrote ../gen/simple_model.py"
    assert build.stdout.splitlines()[-1].startswith("../specs/seed.yaml: SimpleModel")
    assert (root / "gen" / "simple_model.py").exists()
    assert mpgen("check", cwd=root / "docs").stdout == "../gen: up to date\n"


def test_the_command_line_overrides_the_config(tmp_path):
    root = project(tmp_path, CONFIG + 'device-map = "cpu"\n')
    (root / "specs" / "other.yaml").write_text(
        SEED.read_text().replace("name: SimpleModel", "name: Other"))
    build = mpgen("build", "specs/other.yaml", "-o", "mine", "--device-map", "cuda:1=cuda:0",
                  cwd=root)
    assert build.returncode == 0, build.stderr
    assert listing(root / "mine") == sorted(
        ["other.py", "train_other.py", "test_other.py", "pp_other.py", "other.placement.md"])
    assert "--device-map cuda:1=cuda:0" in (root / "mine" / "other.py").read_text()
    assert not (root / "gen").exists()
    # The fix check prints repeats what was typed, no more.
    (root / "mine" / "other.py").unlink()
    check = mpgen("check", "specs/other.yaml", "-o", "mine", cwd=root)
    assert check.returncode == 1
    assert check.stderr.endswith("run: mpgen build specs/other.yaml -o mine\n")


def test_no_specs_and_no_config_is_a_usage_error(tmp_path):
    for config in (None, '[project]\nname = "demo"\n', '[tool.mpgen]\nout = "gen"\n'):
        if config is not None:
            (tmp_path / "pyproject.toml").write_text(config)
        for command in ("build", "check"):
            result = mpgen(command, cwd=tmp_path)
            assert result.returncode == 2
            assert result.stderr.startswith(f"mpgen {command}: no SPEC given and no ")
            assert "[tool.mpgen]" in result.stderr and "Traceback" not in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["pyproject.toml"]


def test_the_search_stops_at_the_project_s_folder(tmp_path):
    project(tmp_path, CONFIG)
    inner = tmp_path / "vendor" / "lib"
    (inner / ".git").mkdir(parents=True)  # another project, without a pyproject.toml
    result = mpgen("build", cwd=inner)
    assert result.returncode == 2
    assert "no [tool.mpgen] specs in a pyproject.toml here or above" in result.stderr


@pytest.mark.parametrize("config, error", [
    (CONFIG + 'device_map = "cpu"\n',
     "pyproject.toml:7:1: [tool.mpgen]: unknown key 'device_map' (did you mean "
     "'device-map'?); known keys: specs, out, device-map, root, time-limit"),
    ('[tool.mpgen]\nspecs = "specs/*.yaml"\n',
     "pyproject.toml:2:9: [tool.mpgen] specs: expected a list of spec paths or globs, like "
     "[\"examples/*.yaml\"], got 'specs/*.yaml'"),
    ('[tool.mpgen]\nspecs = ["specs/*.yaml", 3]\n',
     "pyproject.toml:2:9: [tool.mpgen] specs: expected a list of spec paths or globs, like "
     "[\"examples/*.yaml\"], got the item 3"),
    (CONFIG + "time-limit = true\n",
     "pyproject.toml:7:14: [tool.mpgen] time-limit: expected a number of seconds (0: no "
     "limit), got True"),
    (CONFIG + 'device-map = "cuda0"\n',
     "pyproject.toml:7:14: [tool.mpgen] device-map: invalid device 'cuda0': expected 'cpu' "
     "or 'cuda:N' (did you mean 'cuda:0'?)"),
    ('[tool.mpgen]\nspecs = ["spec/*.yaml"]\n',
     "pyproject.toml:2:9: [tool.mpgen] specs: 'spec/*.yaml' matches no file in ."),
    ('[tool.mpgen]\nspecs = ["specs/*.yaml"\nout = "gen"\n',
     "pyproject.toml:3:1: invalid TOML: Unclosed array"),
    ("[tool]\nmpgen = 3\n", "pyproject.toml:2:1: [tool.mpgen]: expected a table, got 3"),
    ("[tool]\nmpgen = {specs = 3}\n",
     "pyproject.toml:2:1: [tool.mpgen] specs: expected a list of spec paths or globs, like "
     "[\"examples/*.yaml\"], got 3"),
], ids=["unknown-key", "specs-string", "specs-item", "time-limit-bool", "device-map",
        "no-match", "toml", "not-a-table", "inline-table"])
def test_a_bad_config_is_reported_at_its_line(tmp_path, config, error):
    root = project(tmp_path, config)
    for command in ("build", "check"):
        result = mpgen(command, cwd=root)
        assert (result.returncode, result.stderr) == (2, error + "\n")
    assert sorted(os.listdir(root)) == ["pyproject.toml", "specs"]  # nothing written


def test_all_the_mistakes_of_the_table_are_reported_together(tmp_path):
    root = project(tmp_path, '[tool.mpgen]\nspecs = ["specs/*.yaml"]\nout = 3\nroot = ""\n'
                             "time-limit = -1\n")
    result = mpgen("build", cwd=root)
    assert result.returncode == 2
    assert [line.split(": [tool.mpgen]")[0] for line in result.stderr.splitlines()] == [
        "pyproject.toml:3:7", "pyproject.toml:4:8", "pyproject.toml:5:14"]


def test_root_comes_from_the_config_relative_to_its_folder(tmp_path):
    """``mylayers`` lives in lib/, the spec in specs/: found only when
    ``root`` names lib (relative to the config's folder, not the working one)."""
    root = project(tmp_path, '[tool.mpgen]\nspecs = ["specs/gated.yaml"]\nout = "gen"\n')
    (root / "lib").mkdir()
    (root / "lib" / "mylayers.py").write_text(GATE)
    (root / "specs" / "gated.yaml").write_text(GATED.format(name="Gated"))
    (root / "docs").mkdir()
    alone = mpgen("build", cwd=root / "docs")
    assert alone.returncode == 2
    assert "no module 'mylayers'" in alone.stderr, alone.stderr
    with (root / "pyproject.toml").open("a") as f:
        f.write('root = "lib"\n')
    built = mpgen("build", cwd=root / "docs")
    assert built.returncode == 0, built.stderr
    assert (root / "gen" / "gated.py").exists()


def test_time_limit_comes_from_the_config(tmp_path):
    root = project(tmp_path, CONFIG + "time-limit = 0.000001\n")
    result = mpgen("build", cwd=root)
    assert result.returncode == 2
    assert " s build budget; " in result.stderr, result.stderr
    assert mpgen("build", "--time-limit", "0", cwd=root).returncode == 0  # the flag wins
