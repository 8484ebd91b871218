"""Live progress: rank 0 reports each step, the launching process shows it (text here; widgets in Jupyter)."""

import json
import time

import pytest

import ddpkit
from ddpkit import progress, train
from ddpkit.config import TrainConfig


def test_the_trainer_reports_every_step_and_text_mode_shows_them(capsys, monkeypatch):
    monkeypatch.setattr(progress, "TEXT_EVERY_S", 0.0)  # a line for every new batch of steps
    ddpkit.launch(train.run, TrainConfig(steps=6), output="none", progress="text")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[ddpkit] step")]
    assert lines and lines[-1].startswith("[ddpkit] step 6/6"), lines
    steps = [int(ln.split()[2].split("/")[0]) for ln in lines]
    assert steps == sorted(steps), "in step order"
    assert lines[-1].endswith("[mlp, ddp, 2 ranks]"), "each line names its run, so a cell's runs are told apart"


def test_the_runs_of_one_cell_are_named_apart(capsys, monkeypatch, tmp_path):
    """Two runs of notebook 14's cadence comparison differ only in their save rule: the names say which."""
    monkeypatch.setattr(progress, "TEXT_EVERY_S", 0.0)
    for name, rule in (("steps", {"checkpoint_every": 3}), ("seconds", {"checkpoint_every": 0, "checkpoint_every_s": 0.5})):
        ddpkit.launch(train.run, TrainConfig(steps=4, checkpoint_dir=str(tmp_path / name), **rule), output="none", progress="text")
    names = {ln.rsplit("[", 1)[1] for ln in capsys.readouterr().out.splitlines() if ln.startswith("[ddpkit] step")}
    assert names == {"mlp, ddp, 2 ranks, saves every 3 steps]", "mlp, ddp, 2 ranks, saves every 0.5 s]"}, names


def test_text_mode_stays_quiet_while_the_ranks_speak(capsys):
    ddpkit.launch(train.run, TrainConfig(steps=6, log_every=1), output="rank0", progress="text")
    assert "[ddpkit] step" not in capsys.readouterr().out, "rank 0's own table already shows progress"


def test_a_silent_function_gets_a_heartbeat(capsys, monkeypatch):
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.3)
    ddpkit.launch(_sleep, 1.0, output="none", progress="text")
    assert "rank(s) running" in capsys.readouterr().out


def _sleep(ctx, seconds):
    time.sleep(seconds)


def test_off_means_no_progress_file_and_no_lines(capsys, tmp_path):
    ddpkit.launch(train.run, TrainConfig(steps=4), output="none", progress="off", log_dir=str(tmp_path))
    assert not (tmp_path / "progress.jsonl").exists() and "[ddpkit]" not in capsys.readouterr().out


def test_the_progress_file_holds_one_line_per_step(tmp_path):
    ddpkit.launch(train.run, TrainConfig(steps=5), output="none", progress="text", log_dir=str(tmp_path))
    events = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events] == [1, 2, 3, 4, 5] and all(e["total"] == 5 for e in events)


def test_mode_comes_from_the_environment_and_bad_values_name_the_variable(monkeypatch):
    monkeypatch.setenv(progress.ENV_MODE, "text")
    assert progress.resolve_mode("auto") == "text" and progress.resolve_mode("off") == "off"
    monkeypatch.setenv(progress.ENV_MODE, "loud")
    with pytest.raises(ValueError, match=progress.ENV_MODE):
        progress.resolve_mode("auto")
    monkeypatch.delenv(progress.ENV_MODE)
    assert progress.resolve_mode("auto") == "off", "a plain Python process: the CLI prints its own table"


def test_a_bad_mode_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="progress must be one of"):
        ddpkit.launch(_sleep, 0, progress="loud")


def test_the_loss_plot_draws_every_point_between_labelled_axes():
    svg = progress.loss_svg([1, 2, 3, 4], [2.0, 1.5, 1.2, 1.0], total=10)
    points = svg.split('points="')[1].split('"')[0].split()
    assert len(points) == 4 and "optimizer step" in svg and ">loss<" in svg and ">2<" in svg and ">10<" in svg
    ys = [float(p.split(",")[1]) for p in points]
    assert ys == sorted(ys), "a falling loss is drawn going down (SVG y grows downwards)"


def test_a_non_finite_loss_breaks_the_line_and_is_named_instead_of_blanking_the_plot():
    """A NaN inside an SVG points list makes the browser drop the whole line (seen in notebook 14's NaN
    runs); the plot draws the finite parts, scaled to them, and names the first bad step."""
    svg = progress.loss_svg([1, 2, 3, 4, 5], [2.0, 1.5, float("nan"), float("inf"), 1.0], total=5)
    lines = [part.split('"')[0] for part in svg.split('points="')[1:]]
    assert [len(line.split()) for line in lines] == [2, 1] and "nan" not in " ".join(lines) and "inf" not in " ".join(lines)
    assert "non-finite loss at step 3 and 1 more" in svg and ">2<" in svg  # the range is the finite values'
    assert "non-finite" not in progress.loss_svg([1, 2], [2.0, 1.0], total=2)  # the control: nothing to name


def test_a_new_run_in_the_same_launch_starts_a_new_plot(tmp_path):
    """Several trainers in one launch write one progress file: the display follows the run now training,
    rather than joining one run's last step to the next run's first."""
    path = tmp_path / "progress.jsonl"
    display = progress.Display(str(path), "widget", 2)
    path.write_text("".join(json.dumps({"step": s, "total": 3, "loss": 2.0 - s / 10}) + "\n" for s in (1, 2, 3, 1, 2)))
    display._read()
    assert display.steps == [1, 2] and display.losses == [1.9, 1.8]


def test_widget_mode_shows_a_heartbeat_before_the_first_step(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.0)
    monkeypatch.setattr(progress, "POLL_S", 0.0)
    display = progress.Display(str(tmp_path / "progress.jsonl"), "widget", 2)
    display.poll()
    assert "2 rank(s) running" in capsys.readouterr().out
