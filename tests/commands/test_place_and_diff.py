"""`mpgen place` (print / --write the explicit layout) and `mpgen diff`."""

from __future__ import annotations

import subprocess

import pytest

from helpers import EXAMPLES, mpgen, write_spec
from mpgen.cli import main
from mpgen.compiler.driver import compile_spec

TRICKY = """\
# A spec written by hand: comments everywhere, a flow mapping over two lines.
mpgen: 1   # version
name: Tricky
inputs:
  x: [batch, 16]   # input

layers:
  a: {op: Linear, args: [16, 16]}   # first
  h: {op: Linear,
      args: [16, 16], repeat: 4}
  # a comment between layers
  z: {op: Linear, args: [16, 16]}

placement:   # where things go
  # chosen by mpgen
  auto:
    devices: [cuda:0, cuda:1, cuda:2]   # three GPUs
    balance: params

# training below
train:
  batch_size: 2   # small
"""
BEFORE, _, REST = TRICKY.partition("placement:   # where things go\n")
AFTER = REST[REST.index("\n# training below"):]


def devices(path, device_map=None):
    return [(n.name, n.devices) for n in compile_spec(path, device_map).nodes]


def test_place_prints_every_layer_in_the_explicit_form(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(TRICKY)
    assert main(["place", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"# {path}: chosen automatically (balance params over "
                                          "cuda:0, cuda:1, cuda:2); bottleneck 544 parameters")
    assert out.splitlines()[1:] == [
        "placement:",
        "  a: cuda:0",
        "  h.0: cuda:0",
        "  h.1-2: cuda:1",
        "  h.3: cuda:2",
        "  z: cuda:2",
    ]
    assert path.read_text() == TRICKY


def test_place_write_keeps_every_other_byte_and_the_layout(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_bytes(TRICKY.encode())
    auto = devices(path)
    assert main(["place", str(path), "--write"]) == 0
    assert capsys.readouterr().out.startswith(f"rewrote: {path} (")
    text = path.read_bytes().decode()
    assert text.startswith(BEFORE + "placement:   # where things go\n")
    assert text.endswith(AFTER)
    block = text[len(BEFORE):len(text) - len(AFTER)]
    assert block == (
        "placement:   # where things go\n"
        "  # mpgen place --write: auto (balance params over 3 devices; bottleneck 544 "
        "parameters on cuda:0),\n"
        "  # shortest form: 3 bookmarks, one per device run; it replaced:\n"
        "  #   # chosen by mpgen\n"
        "  #   auto:\n"
        "  #     devices: [cuda:0, cuda:1, cuda:2]   # three GPUs\n"
        "  #     balance: params\n"
        "  a: cuda:0\n"
        "  h.1-2: cuda:1\n"
        "  h.3: cuda:2\n"
    )
    assert devices(path) == auto
    # A second --write has nothing left to do.
    assert main(["place", str(path), "--write"]) == 0
    assert capsys.readouterr().out.startswith(f"unchanged: {path}")
    assert path.read_bytes().decode() == text


@pytest.mark.slow  # 65 s: too long for the quick loop
def test_place_write_round_trips_the_gpt2_example(tmp_path):
    path = tmp_path / "gpt2_auto.yaml"
    original = (EXAMPLES / "gpt2_auto.yaml").read_bytes()
    path.write_bytes(original)
    auto = devices(path)
    assert main(["place", str(path), "--write"]) == 0
    assert devices(path) == auto
    old, new = original.decode().splitlines(), path.read_text().splitlines()
    start = old.index("placement:")
    assert new[:start + 1] == old[:start + 1]
    assert new[-7:] == old[-7:]  # the train block, untouched


@pytest.mark.slow  # 4 s: too long for the quick loop
def test_place_write_of_a_flow_placement_with_crlf(tmp_path):
    text = TRICKY.replace(
        "placement:   # where things go\n  # chosen by mpgen\n  auto:\n"
        "    devices: [cuda:0, cuda:1, cuda:2]   # three GPUs\n    balance: params\n",
        "placement: {auto: {devices: [cuda:0, cuda:1]}}   # inline\n",
    ).replace("\n", "\r\n")
    path = tmp_path / "spec.yaml"
    path.write_bytes(text.encode())
    auto = devices(path)
    assert main(["place", str(path), "--write"]) == 0
    new = path.read_bytes().decode()
    head, _, tail = text.partition("placement: {auto: {devices: [cuda:0, cuda:1]}}   # inline\r\n")
    assert new.startswith(head + "placement:\r\n  # mpgen place --write: auto (")
    assert "  #   {auto: {devices: [cuda:0, cuda:1]}}   # inline\r\n" in new
    assert new.endswith("\r\n" + tail)
    assert "\n" not in new.replace("\r\n", "")
    assert devices(path) == auto


def test_place_write_adds_a_block_to_a_spec_without_one(tmp_path):
    path = write_spec(tmp_path, """
        mpgen: 1
        name: Plain
        inputs:
          x: [batch, 4]
        layers:
          a: {op: Linear, args: [4, 4]}
          b: {op: Linear, args: [4, 4]}""")
    original = path.read_text()
    assert not original.endswith("\n")
    assert main(["place", str(path), "--write", "--device-map", "cuda:0=cuda:1"]) == 0
    text = path.read_text()
    assert text.startswith(original + "\n\nplacement:\n")
    assert text.endswith(",\n  # shortest form: 1 bookmark, one per device run\n  a: cuda:1\n")
    assert devices(path) == [("a", ("cuda:1",)), ("b", ("cuda:1",))]


@pytest.mark.slow  # 89 s: too long for the quick loop
def test_place_write_leaves_an_explicit_spec_alone(tmp_path, capsys):
    path = tmp_path / "bert.yaml"
    path.write_bytes((EXAMPLES / "bert_base.yaml").read_bytes())
    assert main(["place", str(path), "--write"]) == 0
    assert capsys.readouterr().out.startswith(f"unchanged: {path} (explicit in the spec)")
    assert path.read_bytes() == (EXAMPLES / "bert_base.yaml").read_bytes()
    # With a device map the mapped layout is written, and reproduces the build.
    mapped = devices(path, {"cuda:3": "cuda:0"})
    assert main(["place", str(path), "--write", "--device-map", "cuda:3=cuda:0"]) == 0
    assert devices(path) == mapped
    assert "  encoder.9-11: cuda:0\n" in path.read_text()


def test_place_of_a_bad_spec_is_a_clean_error(tmp_path):
    path = write_spec(tmp_path, """
        mpgen: 1
        name: Bad
        inputs:
          x: [batch, 4]
        layers:
          a: {op: Linaer, args: [4, 4]}
    """)
    result = mpgen("place", str(path), "--write")
    assert result.returncode == 2
    assert result.stderr.startswith(f"{path}:6:")
    assert "Traceback" not in result.stderr


# -- diff ----------------------------------------------------------------------

STACK = """\
mpgen: 1
name: Stack
inputs:
  x: [batch, 8]
layers:
  a: {{op: Linear, args: [8, 8]}}
  h: {{op: Linear, args: [8, 8], repeat: 4}}
placement:
  a: cuda:0
  h.{split}: cuda:1
train: {{batch_size: 2}}
"""


def test_diff_of_two_files(tmp_path, capsys):
    old = tmp_path / "old.yaml"
    new = tmp_path / "new.yaml"
    old.write_text(STACK.format(split="2"))
    new.write_text(STACK.format(split="3") + "")
    assert main(["diff", str(old), str(new)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"--- {old}\n+++ {new}\n\nmoved:\n  h.2: cuda:1 -> cuda:0\n")
    assert "  cuda:0            216           288" in out  # a, h.0-1 -> a, h.0-2
    assert "  cuda:1            144            72" in out
    assert "  - h.1 [batch, 8]: cuda:0 -> cuda:1 (64 bytes)\n" in out
    assert "  + h.2 [batch, 8]: cuda:0 -> cuda:1 (64 bytes)\n" in out


WIDE = """\
mpgen: 1
name: Wide
inputs:
  x: [batch, 1024]
layers:
  a: {{op: Linear, args: [1024, 1024]}}
  h: {{op: ReLU, repeat: 6}}
placement:
{placement}
train: {{batch_size: 64}}
"""


def wide(path, *entries):
    path.write_text(WIDE.format(placement="".join(f"  {e}\n" for e in entries)))
    return str(path)


def test_diff_warns_when_a_change_multiplies_cross_device_traffic(tmp_path, capsys):
    # One cut (h.2 -> h.3, 64 x 1024 floats) becomes three: h.1 goes to cuda:1 and back.
    old = wide(tmp_path / "old.yaml", "a: cuda:0", "h.3: cuda:1")
    new = wide(tmp_path / "new.yaml", "a: cuda:0", "h.1: cuda:1", "h.2: cuda:0", "h.3: cuda:1")
    assert main(["diff", old, new]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        f"--- {old}\n+++ {new}\n\n"
        "warning: cross-device traffic grows 3.0x per training step (forward): "
        "262,144 bytes (256.0 KiB) -> 786,432 bytes (768.0 KiB); added by:\n"
        "  cuda:0 -> cuda:1: +262,144 bytes (256.0 KiB): h.0 [batch, 1024]\n"
        "  cuda:1 -> cuda:0: +262,144 bytes (256.0 KiB): h.1 [batch, 1024]\n"
        "\nmoved:\n  h.1: cuda:0 -> cuda:1\n")
    assert ("transfers in forward:\n  between devices: 262,144 bytes (256.0 KiB) -> "
            "786,432 bytes (768.0 KiB) per training step\n") in out
    # The way back sends a third: no warning.
    assert main(["diff", new, old]) == 0
    assert "warning" not in capsys.readouterr().out
    # From one device to two: traffic from none.
    one = wide(tmp_path / "one.yaml", "a: cuda:0")
    assert main(["diff", one, old]) == 0
    assert ("warning: cross-device traffic grows from none per training step (forward): "
            "0 bytes (0 B) -> 262,144 bytes (256.0 KiB); added by:\n"
            "  cuda:0 -> cuda:1: +262,144 bytes (256.0 KiB): h.2 [batch, 1024]\n"
            ) in capsys.readouterr().out


def test_diff_does_not_warn_about_small_traffic(tmp_path, capsys):
    # Three times the bytes, but 128 bytes more per step: below TRAFFIC_FLOOR.
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(STACK.format(split="1"))
    new.write_text(STACK.format(split="1").replace("  h.1: cuda:1\n", "  h.1: cuda:1\n"
                                                   "  h.2: cuda:0\n  h.3: cuda:1\n"))
    assert main(["diff", str(old), str(new)]) == 0
    out = capsys.readouterr().out
    assert "between devices: 64 bytes (64 B) -> 192 bytes (192 B) per training step" in out
    assert "warning" not in out


def test_diff_of_identical_layouts(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(STACK.format(split="2"))
    assert main(["diff", str(path), str(path)]) == 0
    out = capsys.readouterr().out
    assert "moved: nothing" in out and "transfers in forward:\n  unchanged" in out


def git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                   check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    git(tmp_path, "init", "-q")
    (tmp_path / "spec.yaml").write_text(STACK.format(split="1-3"))
    git(tmp_path, "add", "spec.yaml")
    git(tmp_path, "commit", "-q", "-m", "first")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_diff_against_a_git_revision(repo, capsys):
    (repo / "spec.yaml").write_text(STACK.format(split="3"))
    assert main(["diff", "HEAD:spec.yaml", "spec.yaml"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--- HEAD:spec.yaml\n+++ spec.yaml\n\n"
                          "moved:\n  h.1-2: cuda:1 -> cuda:0\n")
    assert "  - h.0 [batch, 8]: cuda:0 -> cuda:1 (64 bytes)\n" in out
    assert "  + h.2 [batch, 8]: cuda:0 -> cuda:1 (64 bytes)\n" in out


@pytest.mark.slow  # 3 s: too long for the quick loop
def test_a_side_that_is_both_a_file_and_a_revision_path_is_refused(repo):
    # A file named like REV:path (a pull request can commit one) never
    # silently stands in for the spec in git, nor the other way round.
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                            text=True, check=True).stdout.strip()
    (repo / "spec.yaml").write_text(STACK.format(split="3"))
    (repo / "HEAD:spec.yaml").write_text(STACK.format(split="3"))  # forged: the new layout
    result = mpgen("diff", "HEAD:spec.yaml", "spec.yaml", cwd=repo)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        f"HEAD:spec.yaml:1:1: 'HEAD:spec.yaml' is both a file and a revision:path ('HEAD' is "
        f"commit {commit[:12]}); write './HEAD:spec.yaml' for the file, or "
        f"'{commit}:spec.yaml' for the one in git\n")
    for side, moved in (("./HEAD:spec.yaml", "moved: nothing\n"),
                        (f"{commit}:spec.yaml", "moved:\n  h.1-2: cuda:1 -> cuda:0\n")):
        result = mpgen("diff", side, "spec.yaml", cwd=repo)
        assert result.returncode == 0, result.stderr
        assert moved in result.stdout
    # A name whose REV is no commit is the file it names.
    (repo / "draft:spec.yaml").write_text(STACK.format(split="1-3"))
    result = mpgen("diff", "draft:spec.yaml", "spec.yaml", cwd=repo)
    assert result.returncode == 0 and "moved:\n  h.1-2: cuda:1 -> cuda:0\n" in result.stdout


def test_diff_layers_only_on_one_side(repo, capsys):
    (repo / "spec.yaml").write_text(STACK.format(split="1-3").replace(
        "repeat: 4", "repeat: 5").replace("h.1-3", "h.1-4"))
    assert main(["diff", "HEAD:spec.yaml", "spec.yaml"]) == 0
    out = capsys.readouterr().out
    assert "moved: nothing\nonly in new:\n  h.4: cuda:1\n" in out


def test_diff_errors_have_positions_and_no_traceback(repo):
    result = mpgen("diff", "nope:spec.yaml", "spec.yaml", cwd=repo)
    assert result.returncode == 2
    assert result.stderr.startswith("nope:spec.yaml:1:1: cannot read 'nope:spec.yaml' from git:")
    assert "Traceback" not in result.stderr
    (repo / "spec.yaml").write_text(STACK.format(split="1-3").replace("cuda:1", "gpu1"))
    git(repo, "commit", "-q", "-am", "broken")
    result = mpgen("diff", "HEAD:spec.yaml", "HEAD~1:spec.yaml", cwd=repo)
    assert result.returncode == 2
    assert result.stderr.startswith("HEAD:spec.yaml:10:10: ")
    assert "Traceback" not in result.stderr


def test_diff_from_a_subfolder_suggests_the_path_from_the_current_directory(repo):
    sub = repo / "models" / "gpt"
    sub.mkdir(parents=True)
    (sub / "spec.yaml").write_text(STACK.format(split="1-3"))
    git(repo, "add", "models/gpt/spec.yaml")
    git(repo, "rm", "-q", "spec.yaml")  # no spec.yaml at the root
    git(repo, "commit", "-q", "-m", "the spec moves to a subfolder")
    (sub / "spec.yaml").write_text(STACK.format(split="3"))
    result = mpgen("diff", "HEAD:spec.yaml", "spec.yaml", cwd=sub)
    assert result.returncode == 2
    assert result.stderr == (
        "HEAD:spec.yaml:1:1: cannot read 'HEAD:spec.yaml' from git: fatal: path 'spec.yaml' "
        "does not exist in 'HEAD'; a REV:path is relative to the repository root, and HEAD "
        "has 'spec.yaml' in the current directory: did you mean 'HEAD:./spec.yaml' or "
        "'HEAD:models/gpt/spec.yaml'?\n")
    # Either spelling it suggests reads the subfolder's spec.
    for side in ("HEAD:./spec.yaml", "HEAD:models/gpt/spec.yaml"):
        result = mpgen("diff", side, "spec.yaml", cwd=sub)
        assert result.returncode == 0, result.stderr
        assert "moved:\n  h.1-2: cuda:1 -> cuda:0\n" in result.stdout
    # A path missing in the subfolder too gets git's message alone.
    result = mpgen("diff", "HEAD:other.yaml", "spec.yaml", cwd=sub)
    assert result.stderr.rstrip().endswith("fatal: path 'other.yaml' does not exist in 'HEAD'")


def test_diff_of_a_revision_with_too_many_errors_says_it_stopped(repo):
    from mpgen.errors import MAX_ERRORS, STOPPED

    layers = "".join(f"  l{i}: {{op: Lineer, args: [8, 8]}}\n" for i in range(MAX_ERRORS + 5))
    (repo / "spec.yaml").write_text("mpgen: 1\nname: M\ninputs:\n  x: [batch, 8]\n"
                                    "layers:\n" + layers)
    git(repo, "commit", "-q", "-am", "many errors")
    result = mpgen("diff", "HEAD:spec.yaml", "spec.yaml", cwd=repo)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert lines[0] == "HEAD:spec.yaml:6:12: layer 'l0': unknown op 'Lineer' (did you mean 'Linear'?)"
    assert lines[-1] == STOPPED


def test_diff_never_passes_an_option_to_git(tmp_path, capsys):
    from mpgen.cli import main

    target = tmp_path / "written"
    code = main(["diff", "--", f"--output={target}:spec.yaml", "examples/seed.yaml"])
    assert code == 2
    assert "is not a revision:path" in capsys.readouterr().err
    assert not target.exists()
