"""The drill: every question listed in notebook 16's first cell, one evidence section each, and a timer
mode that asks a seeded random selection, each with its answer."""

import json
from pathlib import Path

import nbformat
import pytest

from ddpkit import drill
from ddpkit.config import TrainConfig
from ddpkit.launch import launch

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "16_interview_drill.ipynb"


def test_the_notebook_lists_and_asks_every_question():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for q in drill.QUESTIONS:
        assert q.question in nb.cells[0].source, q.key
        assert sum(f'drill.ask("{q.key}")' in c.source for c in nb.cells if c.cell_type == "code") == 1, q.key
    assert len({q.key for q in drill.QUESTIONS}) == len(drill.QUESTIONS)


def test_rehearse_asks_a_seeded_random_selection_each_with_its_answer(capsys):
    first = drill.rehearse(3, seconds=0, seed=4)
    out = capsys.readouterr().out
    assert first == drill.rehearse(3, seconds=0, seed=4) and len(set(first)) == 3
    for key in first:
        q = drill.question(key)
        assert q.question in out and q.answer in out
    assert drill.rehearse(100, seconds=0, seed=1) != [q.key for q in drill.QUESTIONS]  # shuffled, and capped at all
    assert sorted(drill.rehearse(100, seconds=0, seed=1)) == sorted(q.key for q in drill.QUESTIONS)


def test_an_unknown_question_names_the_known_ones():
    with pytest.raises(KeyError, match="why-ddp"):
        drill.question("nope")


def test_the_silent_failure_evidence_trains_on_one_nth_of_the_data():
    cfg = TrainConfig(steps=10, dataset_size=512, log_every=100)
    broken = launch(drill.train_with_sampler, cfg, kwargs={"partitioned": False}, world_size=2, output="none")
    right = launch(drill.train_with_sampler, cfg, world_size=2, output="none")
    assert broken[0]["ids"] == broken[1]["ids"] and broken[0]["losses"][-1] < broken[0]["losses"][0]
    assert not set(right[0]["ids"][0]) & set(right[1]["ids"][0])
    json.dumps(right)  # plain data, for a notebook's record
