"""`[tool.mpgen]` in pyproject.toml: what `build` and `check` use for what the
command line leaves out; its mistakes at their line and column."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import EXAMPLES, GATE, GATED, files_in, mpgen, runtime_files

SEED = EXAMPLES / "seed.yaml"


def project(tmp_path: Path, config: str) -> Path:
    """A project holding the seed spec under specs/ and ``config`` as its
    pyproject.toml."""
    tmp_path.mkdir(parents=True, exist_ok=True)
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
    assert files_in(root / "mine") == sorted(
        ["other.py", "train_other.py", "test_other.py", "pp_other.py", "predict_other.py",
         "other.placement.md", *runtime_files()])
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
     "pyproject.toml:7:14: [tool.mpgen] time-limit: expected a number of CPU seconds above "
     "0, at most 600 (the default is 8), got True"),
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


@pytest.mark.slow
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
    assert " s CPU budget of a build; " in result.stderr, result.stderr
    assert mpgen("build", "--time-limit", "60", cwd=root).returncode == 0  # the flag wins


# -- a config a pull request can change (NOTE [A config a pull request can change]) --

def test_the_config_s_default_budget_is_the_compiler_s():
    from mpgen import config
    from mpgen.compiler.frontend.limits import DEFAULT_TIME_LIMIT

    assert config.DEFAULT_TIME_LIMIT == DEFAULT_TIME_LIMIT


@pytest.mark.parametrize("value, error", [
    ("0", "[tool.mpgen] time-limit: expected a number of CPU seconds above 0, at most 600 "
          "(the default is 8), got 0 (a limit can be raised, never removed)"),
    ("0.0", "got 0 (a limit can be raised, never removed)"),
    ("601", "got 601"),
    ("inf", "got inf"),
])
def test_no_time_limit_in_the_config_removes_the_limit(tmp_path, value, error):
    root = project(tmp_path, CONFIG + f"time-limit = {value}\n")
    for command in ("build", "check"):
        result = mpgen(command, cwd=root)
        assert result.returncode == 2
        assert result.stderr.startswith("pyproject.toml:7:14: [tool.mpgen] time-limit: ")
        assert error in result.stderr
    assert not (root / "gen").exists()


@pytest.mark.parametrize("value", ["0", "none", "-1", "nan", "601"])
def test_no_time_limit_on_the_command_line_removes_the_limit(tmp_path, value):
    root = project(tmp_path, CONFIG)
    for command in ("build", "check", "show"):
        args = [command, "--time-limit", value] + (["specs/seed.yaml"] if command == "show" else [])
        result = mpgen(*args, cwd=root)
        assert result.returncode == 2
        assert "is not a number of CPU seconds above 0 and at most 600" in result.stderr
        assert "Traceback" not in result.stderr


def test_the_help_says_cpu_seconds():
    result = mpgen("build", "--help")
    assert "CPU seconds the analysis" in " ".join(result.stdout.split())


def test_a_raised_time_limit_shows_in_the_output_of_build_and_check(tmp_path):
    root = project(tmp_path, CONFIG + "time-limit = 60\n")
    note = "pyproject.toml:7:14: note: time-limit raised to 60 s CPU (default 16 s)\n"
    build = mpgen("build", cwd=root)
    assert build.returncode == 0 and build.stderr.startswith(note), build.stderr
    check = mpgen("check", cwd=root)
    assert (check.returncode, check.stderr) == (0, note)
    lowered = project(tmp_path / "low", CONFIG + "time-limit = 4\n")
    assert "note:" not in mpgen("check", cwd=lowered).stderr  # lowering needs no note
    # The command line wins; the config's value is not used, so no note.
    assert mpgen("check", "--time-limit", "30", cwd=root).stderr == ""


@pytest.mark.parametrize("line, shown", [
    ('out = "gen\\u0000x"', "'gen\\x00x' holds a control character (\\x00)"),
    ('root = "li\\nb"', "'li\\nb' holds a control character (\\n)"),
    ('device-map = "cpu\\u001b[31m"', "holds a control character (\\x1b)"),
], ids=["out-nul", "root-newline", "device-map-escape"])
def test_control_characters_in_the_config_are_errors(tmp_path, line, shown):
    root = project(tmp_path, '[tool.mpgen]\nspecs = ["specs/*.yaml"]\n' + line + "\n")
    result = mpgen("build", cwd=root)
    assert result.returncode == 2, result.stderr
    key = line.split(" =")[0]
    assert result.stderr.startswith(f"pyproject.toml:3:{len(key) + 4}: [tool.mpgen] {key}: ")
    assert shown in result.stderr and "Traceback" not in result.stderr


def test_control_characters_in_a_spec_glob_are_errors(tmp_path):
    root = project(tmp_path, '[tool.mpgen]\nspecs = ["specs/\\u0000*.yaml"]\n')
    result = mpgen("check", cwd=root)
    assert result.returncode == 2
    assert result.stderr.startswith("pyproject.toml:2:9: [tool.mpgen] specs: ")
    assert "holds a control character (\\x00)" in result.stderr


def test_a_config_nested_five_thousand_deep_is_an_error_at_its_place(tmp_path):
    deep = "[" * 5000 + "]" * 5000
    root = project(tmp_path, CONFIG + f"x = {deep}\n")
    for command in ("build", "check"):
        result = mpgen(command, cwd=root)
        assert (result.returncode, result.stderr) == (
            2, "pyproject.toml:7:105: arrays or tables nested more than 100 deep\n")
    # Brackets inside strings and comments are not nesting.
    fine = project(tmp_path / "fine", f'x = "{deep}"  # {deep}\ny = """\n{deep}\n"""\n' + CONFIG)
    assert mpgen("build", cwd=fine).returncode == 0


def git_init(folder: Path) -> None:
    import subprocess

    subprocess.run(["git", "init", "-q", str(folder)], check=True, timeout=60)


@pytest.mark.parametrize("line, problem", [
    ('out = "../escaped"', "'../escaped' is outside the project"),
    ('out = "/tmp/escaped"', "'/tmp/escaped' is absolute"),
    ('out = ".git/hooks"', "'.git/hooks' is inside the repository's git folder"),
    ('root = "../elsewhere"', "'../elsewhere' is outside the project"),
    ('out = "link"', "'link' leads out of the project"),
], ids=["out-dotdot", "out-absolute", "out-git", "root-dotdot", "out-symlink"])
def test_out_and_root_stay_inside_the_repository(tmp_path, line, problem):
    root = project(tmp_path / "repo", '[tool.mpgen]\nspecs = ["specs/*.yaml"]\n' + line + "\n")
    git_init(root)
    (tmp_path / "outside").mkdir()
    (root / "link").symlink_to(tmp_path / "outside")
    for command in (["build"], ["check"], ["build", "--prune"]):
        result = mpgen(*command, cwd=root)
        assert result.returncode == 2, result.stdout + result.stderr
        key = line.split(" =")[0]
        assert result.stderr.startswith(f"pyproject.toml:3:{len(key) + 4}: [tool.mpgen] {key}: ")
        assert problem in result.stderr
    assert os.listdir(tmp_path / "outside") == []
    assert not (tmp_path / "escaped").exists() and not (root / ".git" / "hooks" / "gen").exists()


def test_a_folder_of_the_repository_above_the_config_is_inside(tmp_path):
    """A pyproject.toml in a sub-folder of a repository (a monorepo) may
    name a folder of the repository above its own."""
    repo = tmp_path / "repo"
    root = project(repo / "pkg", CONFIG.replace('out = "gen"', 'out = "../gen"'))
    git_init(repo)
    assert mpgen("build", cwd=root).returncode == 0
    assert (repo / "gen" / "simple_model.py").exists()


def test_a_symlinked_output_folder_on_the_command_line_is_refused(tmp_path):
    root = project(tmp_path / "repo", '[tool.mpgen]\nspecs = ["specs/*.yaml"]\n')
    (tmp_path / "outside").mkdir()
    (root / "generated").symlink_to(tmp_path / "outside")
    for command in (["build"], ["check"], ["build", "--prune"], ["build", "-o", "generated"]):
        result = mpgen(*command, cwd=root)
        assert result.returncode == 2
        assert result.stderr.startswith("generated: the output folder (-o) leads out of the "
                                        "project (.) through a symbolic link, to ")
    assert os.listdir(tmp_path / "outside") == []
    # Written outside the project on the command line: the user's own choice.
    assert mpgen("build", "-o", str(tmp_path / "mine"), cwd=root).returncode == 0


@pytest.mark.parametrize("pattern, problem", [
    ("/**/*.yaml", "'/**/*.yaml' is absolute"),
    ("../*.yaml", "'../*.yaml' leaves this file's folder ('..')"),
    ("specs/../../*.yaml", "leaves this file's folder"),
])
def test_spec_globs_stay_inside_the_project(tmp_path, pattern, problem):
    root = project(tmp_path, f'[tool.mpgen]\nspecs = ["{pattern}"]\n')
    result = mpgen("check", cwd=root)
    assert result.returncode == 2
    assert result.stderr.startswith("pyproject.toml:2:9: [tool.mpgen] specs: ")
    assert problem in result.stderr


def test_a_recursive_glob_does_not_follow_symlinked_folders(tmp_path):
    """Two links to their own folder would make glob's ``**`` explode; a
    link to a folder outside would take it out of the project."""
    root = project(tmp_path / "p", '[tool.mpgen]\nspecs = ["specs/**/*.yaml"]\nout = "gen"\n')
    (root / "specs" / "a").symlink_to(".")
    (root / "specs" / "b").symlink_to(".")
    (root / "specs" / "nested").mkdir()
    (root / "specs" / "nested" / "other.yaml").write_text(
        SEED.read_text().replace("name: SimpleModel", "name: Other"))
    (root / "specs" / ".hidden").mkdir()
    (root / "specs" / ".hidden" / "h.yaml").write_text("not: read\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "x.yaml").write_text("not: read\n")
    (root / "specs" / "out").symlink_to(tmp_path / "outside")
    from mpgen import config

    os.chdir(root)
    assert config.load().spec_paths() == ["specs/nested/other.yaml", "specs/seed.yaml"]


def test_a_spec_glob_matching_a_link_out_of_the_project_is_an_error(tmp_path):
    root = project(tmp_path / "p", CONFIG)
    (tmp_path / "secret.yaml").write_text("token: x\n")
    (root / "specs" / "z.yaml").symlink_to(tmp_path / "secret.yaml")
    result = mpgen("check", cwd=root)
    assert result.returncode == 2
    assert result.stderr.startswith("pyproject.toml:5:9: [tool.mpgen] specs: 'specs/z.yaml' "
                                    "is a symbolic link to ")
    assert "outside the project" in result.stderr and "token" not in result.stderr


def test_a_spec_glob_is_bounded_in_the_files_it_visits(tmp_path, monkeypatch):
    from mpgen import config

    monkeypatch.setattr(config, "MAX_VISITED", 50)
    root = project(tmp_path, '[tool.mpgen]\nspecs = ["**/*.yaml"]\n')
    for i in range(60):
        (root / "specs" / f"n{i}.txt").write_text("")
    result = mpgen("check", cwd=root)
    assert (result.returncode, result.stderr) == (
        2, "pyproject.toml:2:9: [tool.mpgen] specs: '**/*.yaml' looks at more than 50 files "
           "and folders in .; name narrower folders\n")


@pytest.mark.parametrize("pattern, found", [
    ("specs/*.yaml", ["specs/a.yaml", "specs/b.yaml"]),
    ("specs/?.yaml", ["specs/a.yaml", "specs/b.yaml"]),
    ("specs/[a].yaml", ["specs/a.yaml"]),
    ("specs/a.yaml", ["specs/a.yaml"]),
    ("**/*.yaml", ["specs/a.yaml", "specs/b.yaml", "specs/deep/er/c.yaml"]),
    ("specs/**/c.yaml", ["specs/deep/er/c.yaml"]),
    ("specs/**", ["specs/a.yaml", "specs/b.yaml", "specs/deep", "specs/deep/er",
                  "specs/deep/er/c.yaml", "specs/notes.txt"]),
    ("specs/.h*/*.yaml", ["specs/.hidden/h.yaml"]),
    ("./specs//a.yaml", ["specs/a.yaml"]),
])
def test_the_glob_matches_as_glob_did(tmp_path, pattern, found):
    import glob

    from mpgen import config

    (tmp_path / "specs" / "deep" / "er").mkdir(parents=True)
    (tmp_path / "specs" / ".hidden").mkdir()
    for name in ("a.yaml", "b.yaml", "notes.txt", "deep/er/c.yaml", ".hidden/h.yaml"):
        (tmp_path / "specs" / name).write_text("")
    walk = config._Walk(tmp_path, tmp_path)
    assert sorted(walk.glob(pattern)) == found
    expected = sorted(p.rstrip("/").replace("//", "/").removeprefix("./") for p in
                      glob.glob(pattern, root_dir=tmp_path, recursive=True))
    assert sorted(walk.glob(pattern)) == [p for p in expected if p != "specs"]
