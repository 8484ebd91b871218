"""torchft replica groups on real processes: a killed group's peer goes on alone, the restarted one heals.

One module-scoped run of six drills at once (each: a lighthouse and two replica-group processes) feeds
every test; two of them are the negative controls (healing turned off; the commit ignored), two show what
does not work (torchft's own DDP wrappers), each against a drill of the manual loop that works.
"""

import pytest

from ddpkit import ft_replicas

pytestmark = pytest.mark.skipif(not ft_replicas.available(), reason=ft_replicas.MISSING)

DIE = 3


@pytest.fixture(scope="module")
def drills(tmp_path_factory):
    from ddpkit import ft_drill

    common = dict(die_at_step=DIE, steps=8, alone_steps=2)
    return ft_drill.run_drills(str(tmp_path_factory.mktemp("torchft")), {
        "heal": dict(die_mode="between", **common),
        "no_heal": dict(die_mode="between", heal=False, **common),
        "mid": dict(die_mode="allreduce", restart=False, **common),
        "mid_ignoring_commit": dict(die_mode="allreduce", restart=False, ignore_commit=True, **common),
        "ddp_wrapper_mid": dict(die_mode="allreduce", restart=False, wrapper="ddp", **common),
        "pure_wrapper": dict(die_mode="none", steps=3, restart=False, wrapper="pure"),
    }, show=lambda line: None)


def test_the_survivor_goes_on_alone_and_commits_every_step_once(drills):
    heal = drills["heal"]
    assert heal["no_step_lost"] and heal["retried"] == []
    assert heal["first_alone_step"] == DIE and heal["alone_steps"] >= 2
    assert heal["survivor_blocked_s"] > 1.0  # the lighthouse waited out the heartbeat timeout (1.5 s)


def test_the_restarted_replica_heals_to_the_survivors_step_and_weights(drills):
    heal = drills["heal"]
    assert heal["joined_step"] == heal["survivor_step_at_join"] > DIE
    assert heal["heal_bitwise"] and heal["final_sha"]["0"] == heal["final_sha"]["1"]


def test_negative_control_without_healing_the_restarted_replica_is_behind_and_differs(drills):
    no_heal = drills["no_heal"]
    assert no_heal["joined_step"] == 0 < no_heal["survivor_step_at_join"]
    assert not no_heal["heal_bitwise"]


def test_a_death_mid_all_reduce_costs_one_attempt_that_changes_nothing(drills):
    mid = drills["mid"]
    assert mid["retried"] == [{"step": DIE, "unchanged": True}]
    assert mid["no_step_lost"] and mid["first_alone_step"] == DIE


def test_the_failed_attempt_leaves_no_trace(drills):
    """Alone, the survivor's weights after each step are bitwise those of the drill whose peer died between steps."""
    heal, mid = drills["heal"]["survivor_sha"], drills["mid"]["survivor_sha"]
    alone = [s for s in heal if DIE <= int(s) < drills["heal"]["joined_step"] and s in mid]
    assert len(alone) >= 2 and all(heal[s] == mid[s] for s in alone)
    assert all(heal[str(s)] == mid[str(s)] for s in range(DIE))  # and the steps before the death


def test_negative_control_applying_the_uncommitted_attempt_changes_the_weights(drills):
    ignoring = drills["mid_ignoring_commit"]
    assert ignoring["retried"] == [{"step": DIE, "unchanged": False}]
    heal = drills["heal"]["survivor_sha"]
    assert all(ignoring["survivor_sha"][str(s)] != heal[str(s)] for s in range(DIE, DIE + 2))


def test_torchfts_ddp_wrapper_crashes_the_survivor_of_a_death_mid_all_reduce(drills):
    """torchft.ddp.DistributedDataParallel's comm hook asserts on a future that a failed wait() never built."""
    ddp = drills["ddp_wrapper_mid"]
    assert ddp["crashed"]["error"] == "AssertionError" and ddp["crashed"]["where"].startswith("torchft/ddp.py:")
    assert ddp["crashed"]["step"] == DIE and ddp["committed_steps"] == list(range(DIE)) and "first_alone_step" not in ddp
    # the same death under the manual loop (the control): the survivor goes on
    assert "crashed" not in drills["mid"] and drills["mid"]["first_alone_step"] == DIE


def test_torchfts_ddp_wrapper_trains_like_the_manual_loop_until_then(drills):
    # the comparison can come out equal: before the death the wrapper's weights are the manual loop's, bit for bit
    ddp, heal = drills["ddp_wrapper_mid"]["survivor_sha"], drills["heal"]["survivor_sha"]
    assert [ddp[str(s)] for s in range(DIE)] == [heal[str(s)] for s in range(DIE)]


def test_torchfts_pure_wrapper_trains_something_else_without_any_failure(drills):
    """PureDistributedDataParallel never waits on its all-reduces, so the division by the participants (a
    callback run on wait()) never happens and the step may read a gradient still being reduced."""
    pure, heal = drills["pure_wrapper"], drills["heal"]
    assert pure["retried"] == [] and pure["no_step_lost"] and "crashed" not in pure
    assert pure["losses"]["0"] == heal["losses"]["0"], "the same first batch from the same weights"
    before_death = [s for s in pure["survivor_sha"] if int(s) < DIE]  # the heal drill's steps with two replicas
    assert "0" in before_death and all(pure["survivor_sha"][s] != heal["survivor_sha"][s] for s in before_death)


def test_the_drill_refuses_in_one_line_without_torchft(monkeypatch, tmp_path):
    from ddpkit import ft_drill

    monkeypatch.setattr(ft_drill, "available", lambda: False)
    with pytest.raises(RuntimeError, match=r"pip install 'ddpkit\[ft\]'"):
        ft_drill.run_drill(str(tmp_path))


def test_a_replica_left_training_alone_ends_the_drill_with_the_reason():
    """When the replicas must end together and one has finished, the other waits for a peer that is gone:
    the drill says so after LONE_FINISH_S instead of running to its timeout; before that, and when the
    drill's replicas need not end together, nothing is raised."""
    import time

    from ddpkit import ft_drill

    class Process:  # what the drill reads of a replica process: poll() and finished_at
        def __init__(self, code, finished_at=None):
            self.code, self.finished_at = code, finished_at

        def poll(self):
            return self.code

    long_ago = time.monotonic() - ft_drill.LONE_FINISH_S - 1
    with pytest.raises(RuntimeError, match="process 0 finished but process 1 still trains alone"):
        ft_drill._refuse_a_lone_finish([Process(0, long_ago), Process(None)], True, "", "logs")
    ft_drill._refuse_a_lone_finish([Process(0, long_ago), Process(None)], False, "", "logs")  # need not end together
    ft_drill._refuse_a_lone_finish([Process(0, time.monotonic()), Process(None)], True, "", "logs")  # just finished
    ft_drill._refuse_a_lone_finish([Process(0, long_ago), Process(-9), Process(0, long_ago)], True, "", "logs")
