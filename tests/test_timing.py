"""The sign test behind notebook 10's and 13's timing lessons, and notebook 10's negative control: with
recomputation removed, the notebook's own measurement (``timing.recompute_cost``) gives the verdict its
check refuses."""

import random

import torch

from ddpkit import timing
from ddpkit.config import TrainConfig
from ddpkit.models import build_model


def test_verdict_is_a_sign_test():
    assert timing.verdict([1.3] * 7, 1.1) == "above"  # 7 of 7 above: p = 1/128 < 0.01
    assert timing.verdict([1.3] * 6, 1.1) == "unclear"  # 6 of 6: p = 1/64, not sure at 99%
    assert timing.verdict([0.9] * 7, 1.1) == "below"
    noisy = [1.1 + random.Random(0).uniform(-0.2, 0.2) for _ in range(8)]
    assert timing.verdict(noisy + [1.1 - (x - 1.1) for x in noisy], 1.1) == "unclear"  # symmetric: no sign


def test_until_sure_stops_as_soon_as_it_is_sure_and_gives_up_at_max_n():
    values = iter([1.5] * 100)
    seen, taken = timing.until_sure(lambda: next(values), 1.1, min_n=3, max_n=30)
    assert seen == "above" and len(taken) == 7
    flip = iter([0.5, 1.5] * 50)
    seen, taken = timing.until_sure(lambda: next(flip), 1.0, min_n=3, max_n=12)
    assert seen == "unclear" and len(taken) == 12


def test_without_recomputation_the_activation_checkpointing_check_fails():
    """Negative control for notebook 10: its own measurement (``timing.recompute_cost``) on a model that
    ignores the switch, so neither arm recomputes. The pairs' ratios sit around 1, below the 10% the
    lesson claims, and the sign test says so: "below", which the notebook's ``seen != "below"`` refuses."""
    torch.set_num_threads(1)
    model = build_model(TrainConfig(model="gpt", d_model=128, n_layers=4, seq_len=64))  # notebook 10's model

    class IgnoresTheSwitch(type(model)):  # the mechanism removed: recomputation never happens
        activation_checkpointing = property(lambda self: False, lambda self, value: None)

    model.__class__ = IgnoresTheSwitch
    tokens = torch.randint(0, 64, (8, 64), generator=torch.Generator().manual_seed(0))  # half its batch: quicker
    cost = timing.recompute_cost(model, tokens, 1.10, min_n=8, max_n=40, show=lambda line: None)
    assert cost["verdict"] == "below", cost["ratios"]
