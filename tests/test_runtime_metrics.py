"""The training loop's metrics component: which steps print (and read back) their loss, the CSV it keeps."""
from __future__ import annotations

from pipefisher.runtime.train.metrics import CSV_HEADER, Metrics


def test_should_log_every_log_every_steps_the_last_step_and_evaluation_steps():
    m = Metrics(reporter=True, mode="kfac", steps=12, log_every=5, progress=False, evaluates=lambda s: s == 7)
    assert [s for s in range(12) if m.should_log(s)] == [0, 5, 7, 10, 11]


def test_should_log_every_step_with_log_every_one():
    m = Metrics(reporter=True, mode="first-order", steps=4, log_every=1, progress=False)
    assert all(m.should_log(s) for s in range(4))


def test_record_prints_the_loss_only_on_logging_steps(capsys, cli_lines):
    m = Metrics(reporter=True, mode="first-order", steps=4, log_every=3, progress=False)
    for step in range(4):
        m.record(step, loss=1.0 + step, val=0.5 if step == 3 else None, lr=1e-3, seconds=0.01, cycle=None)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["step     0  loss 1.0000  10.0 ms", "step     3  loss 4.0000  held-out 0.5000  10.0 ms"]


def test_only_the_reporting_worker_prints_and_writes_the_csv(tmp_path, capsys, cli_lines):
    path = tmp_path / "m.csv"
    m = Metrics(reporter=False, mode="first-order", steps=2, progress=False, csv=str(path))
    m.record(0, loss=None, val=None, lr=1e-3, seconds=0.01, cycle=None)
    m.write_csv()
    assert not path.exists() and capsys.readouterr().out == ""


def test_csv_keeps_an_earlier_runs_rows_before_the_resumed_step(tmp_path):
    class Refresh:
        drift, aging = 0.25, None

    path = tmp_path / "m.csv"
    path.write_text(CSV_HEADER + "0,9.000000,,0.001,0.100000,kfac,,,,\n1,8.000000,,0.001,0.100000,kfac,,,,\n"
                    "2,7.000000,,0.001,0.100000,kfac,,,,\n")
    m = Metrics(reporter=True, mode="kfac", steps=3, first=2, progress=False, csv=str(path),
                overruns=lambda: {2: 0.5}, refreshes=lambda: {2: Refresh()})
    m.record(2, loss=6.5, val=6.0, lr=5e-4, seconds=0.2, cycle=3)
    m.write_csv()
    assert path.read_text().splitlines() == [
        CSV_HEADER.strip(), "0,9.000000,,0.001,0.100000,kfac,,,,", "1,8.000000,,0.001,0.100000,kfac,,,,",
        "2,6.500000,6.000000,0.0005,0.200000,kfac,3,0.500000,0.250000,"]
