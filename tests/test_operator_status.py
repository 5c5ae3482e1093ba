"""metav1.Condition bookkeeping: `headroom.operator.status.set_condition` and the status a loop
writes with `set_status_condition`."""

from __future__ import annotations

from headroom.operator.status import get_condition, rfc3339, set_condition, set_status_condition


def test_last_transition_time_moves_only_when_the_status_flips() -> None:
    """A new reason or message keeps lastTransitionTime; a new status moves it (API conventions)."""
    first = set_condition([], "Ready", "False", "ReplicasNotReady", "0/1 replicas ready",
                          generation=1, now=100.0)  # fmt: skip
    same = set_condition(first, "Ready", "False", "RollingOut", "rolling", generation=2, now=200.0)
    (cond,) = same
    assert (cond["reason"], cond["message"], cond["observedGeneration"]) == (
        "RollingOut",
        "rolling",
        2,
    )
    assert cond["lastTransitionTime"] == rfc3339(100.0)
    (flipped,) = set_condition(same, "Ready", "True", "AllReplicasReady", "1/1 replicas ready",
                               generation=2, now=300.0)  # fmt: skip
    assert flipped["lastTransitionTime"] == rfc3339(300.0)


def test_a_loop_s_write_keeps_the_transition_time_the_object_holds() -> None:
    """A loop's status carries only its own conditions, yet the time comes from the object."""
    held = set_condition([], "Ready", "True", "AllReplicasReady", "2/2 replicas ready",
                         generation=3, now=100.0)  # fmt: skip
    body = {"metadata": {"generation": 4}, "status": {"conditions": held}}
    status: dict = {}
    set_status_condition(body, status, "Ready", "True", "AllReplicasReady", "3/3 replicas ready",
                         now=200.0)  # fmt: skip
    cond = get_condition(status["conditions"], "Ready")
    assert cond is not None
    assert cond["lastTransitionTime"] == rfc3339(100.0)
    assert (cond["message"], cond["observedGeneration"]) == ("3/3 replicas ready", 4)


def test_a_message_is_cut_to_the_api_s_limit() -> None:
    """metav1.Condition's message holds at most 32768 characters; the apiserver refuses more."""
    (cut,) = set_condition([], "Ready", "False", "X", "m" * 40_000, generation=1, now=1.0)
    assert len(cut["message"]) == 32_768
    (whole,) = set_condition([], "Ready", "False", "X", "m" * 32_768, generation=1, now=1.0)
    assert len(whole["message"]) == 32_768
