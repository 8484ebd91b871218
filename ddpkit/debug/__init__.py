"""Debugging a distributed job: mismatched collectives, torch's Flight Recorder, silent bugs, timelines.

* :mod:`ddpkit.debug.mismatch`: ranks that disagree about a collective, with and without
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, and a rank that skips a collective in a branch;
* :mod:`ddpkit.debug.flight`: every rank's ring of recent collectives (torch's Flight Recorder), dumped
  and analyzed with torch's own analyzer, which names the culprit rank (reading the dumps:
  :mod:`ddpkit.debug.flight_read`; the analysis and the stall report: :mod:`ddpkit.debug.flight_report`);
* :mod:`ddpkit.debug.silent`: bugs that never crash, each caught by a check the kit provides;
* :mod:`ddpkit.debug.timeline`: ``torch.profiler`` on real DDP ranks, compute and communication on one
  timeline, and how much of the communication hid behind compute;
* :mod:`ddpkit.debug.buckets`: how DDP sizes its gradient buckets (``bucket_cap_mb`` and the first-bucket
  rule), checked against the buckets DDP builds, and a sweep of step time and overlap against the size.
"""
