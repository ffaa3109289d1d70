"""`mpgen place --fit`'s parts that need no plan: --capacity's syntax and the
rewrite of the batch (and micro-batch count), every other byte kept."""

from __future__ import annotations

import pytest

from helpers import mpgen
from mpgen.commands.place import fit_text, parse_capacity
from mpgen.errors import MpgenError


def test_capacity_reads_devices_and_sizes():
    assert parse_capacity("cuda:0=24GiB, cuda:1 = 512MB,cpu=1000") == {
        "cuda:0": 24 * 1024 ** 3, "cuda:1": 512 * 10 ** 6, "cpu": 1000}


@pytest.mark.parametrize("text, message", [
    ("cuda:0", "--capacity: 'cuda:0' is not DEVICE=SIZE (such as cuda:0=24GiB)"),
    ("gpu0=1GiB", "--capacity: invalid device 'gpu0': expected 'cpu' or 'cuda:N' (did you "
                  "mean 'cuda:0'?)"),
    ("cuda:0=lots", "--capacity: invalid memory size 'lots': expected e.g. '40GiB', '512MB' "
                    "or bytes"),
    ("cuda:0=1GiB,cuda:0=2GiB", "--capacity: cuda:0 is given twice"),
])
def test_a_bad_capacity_says_which_item(text, message):
    with pytest.raises(MpgenError) as info:
        parse_capacity(text)
    assert str(info.value) == message


def test_capacity_without_fit_is_a_usage_error(tmp_path):
    ran = mpgen("place", str(tmp_path / "spec.yaml"), "--capacity", "cuda:0=1GiB")
    assert ran.returncode == 2
    assert ran.stderr.strip() == ("mpgen place: --capacity is for --fit (mpgen place SPEC "
                                  "--fit --capacity ...)")


HEAD = "mpgen: 1\nname: M\ninputs:\n  x: [batch, 4]\nlayers:\n  a: {op: Linear, args: [4, 4]}\n"


@pytest.mark.parametrize("before, after", [
    # the batch where the spec states it, comments and layout kept
    ("train:\n  batch_size: 8   # small\n  steps: 2\n",
     "train:\n  batch_size: 48   # small\n  steps: 2\n"),
    ("train: {steps: 2, batch_size: 8}\n", "train: {steps: 2, batch_size: 48}\n"),
    # train.dims.batch sizes the batch over batch_size: it is the one written
    ("train:\n  batch_size: 8\n  dims: {batch: 4}\n",
     "train:\n  batch_size: 8\n  dims: {batch: 48}\n"),
    # added where the spec does not state it
    ("train:\n    steps: 2   # two\n# end\n",
     "train:\n    steps: 2   # two\n    batch_size: 48\n# end\n"),
    ("train: {steps: 2}\n", "train: {steps: 2, batch_size: 48}\n"),
    ("train: {}\n", "train: {batch_size: 48}\n"),
    ("", "\ntrain:\n  batch_size: 48\n"),
    # the micro-batch count, only where it changes
    ("pipeline:\n  microbatches: 2  # M\ntrain:\n  batch_size: 8\n",
     "pipeline:\n  microbatches: 6  # M\ntrain:\n  batch_size: 48\n"),
])
def test_the_batch_is_written_where_it_is_read(before, after):
    m = 6 if "microbatches" in before else None
    assert fit_text(HEAD + before, 48, m) == HEAD + after


def test_crlf_line_endings_are_kept():
    text = (HEAD + "train:\n  steps: 2\n").replace("\n", "\r\n")
    assert fit_text(text, 48, None) == text + "  batch_size: 48\r\n"
