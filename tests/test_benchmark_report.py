"""The benchmark report: built from the committed results, with every plot, and the README's table is the
one the report generates (so the README shows the last measured numbers, not hand-copied ones)."""

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
