"""The runtime's flags, data and checkpoints in process (mpgen/runtime)."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch

from mpgen.runtime import checkpoint, data, flags
from tiny import STAGES, TRAINING, training

TRAIN_FLAGS = {"--steps", "--epochs", "--batch-size", "--lr", "--seed", "--log-every",
               "--log-dir", "--checkpoint", "--save-every", "--resume", "--amp",
               "--grad-clip", "--accumulate", "--data", "--eval-data", "--eval-split",
               "--eval-every", "--samples", "--workers", "--init", "--memory", "--set"}
TRAIN_FLAGS |= {"--monitor", "--monitor-mode", "--keep-last", "--early-stop"}
TRAIN_FLAGS |= {"--threads"}  # torch's intra-op threads (runtime/threads.py)
TRAIN_FLAGS |= {"--logger"}  # W&B or MLflow beside log.csv (runtime/trackers.py)
# Every flag of the single-process script that applies (not fp16's --amp: a
# gradient scaler would span the ranks), and the pipeline's own.
PIPELINE_FLAGS = TRAIN_FLAGS | {"--microbatches", "--schedule", "--decay-steps", "--merge",
                                "--dp", "--dp-mode", "--timeout", "--sync-bn", "--no-sync-bn"}


def options(parser) -> set[str]:
    return {o for action in parser._actions for o in action.option_strings} - {"-h", "--help"}


def test_each_script_has_its_flags_with_the_specs_defaults():
    assert options(flags.parser(TRAINING)) == TRAIN_FLAGS
    assert options(flags.parser(TRAINING, STAGES)) == PIPELINE_FLAGS
    args = flags.parser(TRAINING).parse_args([])
    assert (args.steps, args.batch_size, args.lr, args.samples) == (6, 4, 0.1, 64)
    assert (args.seed, args.amp, args.workers, args.epochs) == (0, "off", 0, None)
    # A built-in schedule reads --decay-steps; the pipeline program always has it.
    decaying = training(defaults=TRAINING.defaults | {"decay_steps": 9})
    assert flags.parser(decaying).parse_args([]).decay_steps == 9
    assert flags.parser(TRAINING, STAGES).parse_args([]).decay_steps == 6
    # --sync-bn's default is the spec's pipeline: {sync_bn: ...}
    assert flags.parser(TRAINING, STAGES).parse_args([]).sync_bn is False
    synced = dataclasses.replace(STAGES, sync_bn=True)
    assert flags.parser(TRAINING, synced).parse_args([]).sync_bn is True
    assert flags.parser(TRAINING, synced).parse_args(["--no-sync-bn"]).sync_bn is False


@pytest.mark.parametrize("argv, message", [
    (["--resume"], "--resume needs --checkpoint DIR"),
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--lr", "inf"], "--lr must be a finite number >= 0, got inf"),
    (["--eval-split", "1"], "--eval-split takes a fraction in [0, 1)"),
])
def test_arguments_the_run_cannot_use_stop_in_one_usage_line(argv, message, capsys):
    parser = flags.parser(TRAINING)
    with pytest.raises(SystemExit) as stop:
        flags.check(parser, parser.parse_args(argv))
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"{parser.prog}: error: {message}\n"


@pytest.mark.parametrize("argv, message", [
    (["--batch-size", str(2**31)], "--batch-size must be at most 2,147,483,647, got 2,147,483,648"),
    (["--samples", "9" * 30], "--samples must be at most 2,147,483,647, got 999,999"),
    (["--microbatches", str(2**40)], "--microbatches must be at most 2,147,483,647"),
    (["--dp", str(2**31)], "--dp must be at most 2,147,483,647"),
    (["--accumulate", str(2**31)], "--accumulate must be at most 2,147,483,647"),
    (["--steps", str(2**63)], "--steps must be at most 9,223,372,036,854,775,807"),
    (["--timeout", "1e300"], "--timeout must be a positive number of seconds, at most 31536000"),
])
def test_every_size_from_the_command_line_is_bounded_in_one_line(argv, message, capsys):
    # A size becomes a tensor's (a batch, the synthetic dataset): past a dim's
    # most it is a usage line, never an overflow inside torch.
    parser = flags.parser(TRAINING, STAGES)
    with pytest.raises(SystemExit) as stop:
        flags.check(parser, parser.parse_args(argv))
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{parser.prog}: error: {message}") and err.count("\n") == 1, err


def test_a_synthetic_sample_is_a_function_of_the_seed_and_its_index():
    one, other = data.SyntheticData(TRAINING, 8, seed=3), data.SyntheticData(TRAINING, 8, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(one[5], other[5]))
    assert not torch.equal(one[5][0], data.SyntheticData(TRAINING, 8, seed=4)[5][0])
    shifted = data.SyntheticData(TRAINING, 4, seed=3, first=4)
    assert torch.equal(shifted[1][0], one[5][0])


def test_batches_from_any_step_continue_the_stream_across_epochs():
    samples = data.SyntheticData(TRAINING, 12, seed=0)
    args = SimpleNamespace(batch_size=4, seed=0, workers=0)
    stream = list(itertools.islice(data.batches(samples, TRAINING, args, 0), 7))  # 2 epochs+
    resumed = list(itertools.islice(data.batches(samples, TRAINING, args, 4), 3))
    for a, b in zip(stream[4:], resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # Each epoch is a shuffled pass over every sample.
    first_epoch = torch.cat([batch[0] for batch in stream[:3]])
    assert sorted(first_epoch[:, 0].tolist()) == sorted(samples[i][0][0].item() for i in range(12))


def test_a_data_file_without_a_key_stops_naming_it(tmp_path):
    torch.save({"x": torch.zeros(4, 4)}, tmp_path / "d.pt")
    with pytest.raises(SystemExit, match=r"d.pt: no tensor target \(it has x\)"):
        data.load_data(str(tmp_path / "d.pt"), {}, "--data", TRAINING)


def test_eval_split_holds_out_a_disjoint_fraction():
    args = SimpleNamespace(eval_data=None, eval_split=0.25, eval_every=0, data=None, seed=0,
                           batch_size=2, workers=0, samples=16)
    kept, held = data.split_data(TRAINING, args, None, data.SyntheticData(TRAINING, 16, 0))
    assert len(kept) == 12 and len(held.dataset) == 4
    assert not set(kept.indices) & set(held.dataset.indices)


def test_a_checkpoint_is_replaced_whole_or_not_at_all(tmp_path):
    path = tmp_path / "last.pt"
    checkpoint.save({"step": 1}, path)
    with pytest.raises(Exception):
        checkpoint.save({"step": 2, "bad": lambda: 0}, path)  # cannot be pickled
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt"]  # no temporary left


def test_a_checkpoint_restores_the_model_optimizer_and_every_rng(tmp_path):
    model = TRAINING.model()
    optimizer = TRAINING.optimizer(model, SimpleNamespace(lr=0.1))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    checkpoint.save(checkpoint.state(model, optimizer, None, None, 7), tmp_path / "c.pt")
    expected = torch.rand(3)
    again = TRAINING.model()
    fresh = TRAINING.optimizer(again, SimpleNamespace(lr=0.1))
    assert checkpoint.restore(checkpoint.load(tmp_path / "c.pt"), again, fresh, None, None) == 7
    assert torch.equal(torch.rand(3), expected)  # the RNG as it was when saved
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  again.state_dict().values()))
    assert fresh.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()


def test_the_compilers_copy_of_the_runtimes_defaults_is_the_runtimes():
    # codegen writes only the defaults that differ from these (it cannot
    # import the runtime, which imports torch's TensorBoard and tqdm).
    import dataclasses

    from mpgen.compiler.codegen import pp, train
    from mpgen.runtime import Stages, spec

    assert train.BASE_DEFAULTS == spec.BASE_DEFAULTS
    fields = {f.name: f.default for f in dataclasses.fields(Stages)}
    assert pp.STAGES_DEFAULTS == {key: fields[key] for key in pp.STAGES_DEFAULTS}
