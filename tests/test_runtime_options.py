"""How a run trains: options in sections that check themselves, one check shared with the command line."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from pipefisher.cli import main
from pipefisher.errors import InputError
from pipefisher.runtime.job.options import (FLAGS, RUN_OPTIONS, AdaptOptions, CheckpointOptions, EvalOptions,
                                            LogOptions, OptionError, TrainOptions)

from _schedules import TINY


def test_the_options_come_in_sections_and_the_flags_name_their_fields():
    opts = TrainOptions.of(mode="scheduled", schedule="s.pickle", log_every=3, out="o", eval_every=2,
                           checkpoint_dir="ck", checkpoint_every=4, adapt=True, adapt_drift=True, margin=0.1)
    assert opts.log == LogOptions(every=3, out="o") and opts.evaluation == EvalOptions(every=2)
    assert opts.checkpoint == CheckpointOptions(folder="ck", every=4)
    assert opts.adapt == AdaptOptions(enabled=True, drift=True, margin=0.1)
    assert TrainOptions.of(**opts.flags()) == opts and list(opts.flags()) == list(FLAGS)
    assert set(RUN_OPTIONS) <= set(FLAGS)  # what a manifest records, by the same names
    with pytest.raises(TypeError, match="no option log_evry"):
        TrainOptions.of(log_evry=3)


@pytest.mark.parametrize("flags, problem", [
    ({"log_every": 0}, "log.every must be at least 1 step, not 0"),
    ({"eval_every": -1}, "evaluation.every must be at least 0 steps, not -1"),
    ({"checkpoint_every": -1}, "checkpoint.every must be at least 0 steps"),
    ({"mode": "scheduled", "schedule": "s", "adapt": True, "adapt_aging_low": 0.5, "adapt_aging_high": 0.2},
     "aging thresholds"),
])
def test_each_section_checks_itself(flags, problem):
    with pytest.raises(ValueError, match=problem):
        TrainOptions.of(**flags)


@pytest.mark.parametrize("args, flags", [
    (["--adapt"], {"adapt": True}),
    (["--profile", "--schedule", "s.pickle", "--out", "o"],
     {"profile": True, "schedule": "s.pickle", "mode": "scheduled"}),
    (["--mode", "scheduled"], {"mode": "scheduled"}),
    (["--schedule", "s.pickle", "--mode", "kfac"], {"schedule": "s.pickle", "mode": "kfac"}),
])
def test_the_command_line_and_the_options_refuse_with_one_check_in_one_line(args, flags):
    """``train``'s flags are refused by the options' own check, before torch loads: the same one line a
    library caller gets (as an input error, and a ValueError)."""
    with pytest.raises(OptionError) as err:
        TrainOptions.of(**flags)
    assert isinstance(err.value, ValueError) and isinstance(err.value, InputError)
    res = CliRunner().invoke(main, ["train", "--config", TINY, "--no-progress", *args])
    assert (res.exit_code, res.output) == (2, f"error: {err.value}\n")
