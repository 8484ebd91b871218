"""What a rank sends back: CPU copies of its tensors, each with no more storage than its own elements."""

import pickle

import torch

from ddpkit.launch import launch
from ddpkit.rank import dumps_cpu


def _slice_of_a_thousand(ctx):
    return {"first_four": torch.arange(1000, dtype=torch.float32)[:4], "column": torch.ones(50, 20)[:, 3]}


def test_a_returned_view_carries_its_own_elements_not_its_whole_storage():
    view = torch.arange(1000, dtype=torch.float32)[:4]  # 16 bytes of a 4000-byte storage
    assert len(pickle.dumps(view)) > 4000  # as plain pickle ships it
    assert len(dumps_cpu(view)) < len(pickle.dumps(torch.arange(4, dtype=torch.float32))) + 100
    out = launch(_slice_of_a_thousand, world_size=1, output="none")[0]
    assert out["first_four"].tolist() == [0.0, 1.0, 2.0, 3.0] and out["first_four"].untyped_storage().nbytes() == 16
    assert out["column"].equal(torch.ones(50)) and out["column"].untyped_storage().nbytes() == 200
