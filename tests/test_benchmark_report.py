"""The benchmark report: built from the committed results, with every plot, and the README's table (and the
sentences of its prose that quote measurements) are the ones the report generates (so the README shows the
last measured numbers, not hand-copied ones)."""

import shutil
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import report  # noqa: E402


def test_the_readme_table_is_the_generated_one():
    table = report.markdown_table(report.table_rows(report.load()))
    readme = Path(report.README).read_text()
    assert f"{report.START}\n{table}\n{report.END}" in readme, "run python benchmarks/report.py"


def test_the_readme_sentences_that_quote_results_are_the_generated_ones():
    r = report.load()
    sentences = report.prose(r)
    assert set(sentences) == {"trainer-runs", "weak-scaling"}
    readme = Path(report.README).read_text()
    for name, sentence in sentences.items():
        start, end = report.markers(name)
        assert f"{start}{sentence}{end}" in readme, f"run python benchmarks/report.py ({name})"
    runs = r["trainer_overhead"]["step_overhead"]["over_runs"]["paired_ratio"]["n"]
    assert f"{runs} runs" in sentences["trainer-runs"] and f"over {runs} runs" in report.markdown_table(report.table_rows(r))
    trace = r["trainer_overhead"]["weak_scaling"]["profiled_ddp_step"]
    assert f"{1e3 * trace['comm_s']:.0f} ms of the {1e3 * trace['wall_s']:.0f} ms step" in sentences["weak-scaling"]


def test_a_stale_sentence_is_rewritten_from_the_results(tmp_path):
    readme = tmp_path / "README.md"
    start, end = report.markers("trainer-runs")
    readme.write_text(f"{report.START}\n{report.END}\nSo: {start}16 runs in two batches of 8{end} and more.\n")
    sentences = {"trainer-runs": report.prose(report.load())["trainer-runs"]}
    report.update_readme(str(readme), "| a |", sentences)
    text = readme.read_text()
    assert "16 runs" not in text and f"So: {start}{sentences['trainer-runs']}{end} and more." in text
    readme.write_text(f"{report.START}\n{report.END}\nno sentence markers\n")  # control: a sentence with nowhere to go
    with pytest.raises(ValueError, match="benchmarks:trainer-runs"):
        report.update_readme(str(readme), "| a |", sentences)


def test_a_report_is_written_with_every_plot_and_no_result_is_invented(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(report.RESULTS, results, ignore=shutil.ignore_patterns("plots", "REPORT.md"))
    text = Path(report.write_report(str(results), readme=None)).read_text()
    for plot in ("launch_latency", "allreduce_bandwidth", "memory_per_rank", "pipeline_bubble", "recovery", "checkpoint_cost",
                 "bucket_sweep"):
        assert (results / "plots" / f"{plot}.png").stat().st_size > 1000 and f"plots/{plot}.png" in text
    (results / "pipeline_bubble.json").unlink()
    text = Path(report.write_report(str(results), readme=None)).read_text()
    assert "pipeline bubble" not in text.lower()


def test_a_readme_without_markers_is_refused(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("no table here\n")
    with pytest.raises(ValueError, match="markers"):
        report.update_readme(str(readme), "| a |")
