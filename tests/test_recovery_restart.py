"""The kit's own checkpoint restart, the row notebook 21 sets beside torchft and elastic torchrun.

``recovery.restart_drill`` runs ``ddpkit train --max-restarts 1`` with a rank SIGKILLed mid-run: the work
it loses is the steps done since the newest checkpoint, so a run that saves every step (the control)
loses none.
"""

import pytest

from ddpkit import recovery


def test_a_restart_redoes_the_steps_since_its_newest_checkpoint(tmp_path):
    run = recovery.restart_drill(str(tmp_path), steps=8, fail_at_step=5, checkpoint_every=3)
    assert run["steps"] == 8 and run["restarts"] == 1
    assert run["resumed_from"] == run["saved_before"] == 3, "resumed from the newest checkpoint saved before the death"
    assert run["steps_done_twice"] == 2, "steps 4 and 5 were done before the death, and again after it"
    assert run["total_s"] > 0 and run["detection_s"] >= 0
    assert any("restarting all 2 ranks" in line for line in run["said"])


def test_negative_control_a_run_that_saves_every_step_redoes_none(tmp_path):
    run = recovery.restart_drill(str(tmp_path), steps=8, fail_at_step=5, checkpoint_every=1)
    assert run["resumed_from"] == run["saved_before"] == 5 and run["steps_done_twice"] == 0


def test_a_death_before_the_first_checkpoint_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_every"):
        recovery.restart_drill(str(tmp_path), steps=8, fail_at_step=2, checkpoint_every=3)
