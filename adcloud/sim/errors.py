"""Errors of the replay-simulation service."""

from __future__ import annotations

from adcloud.errors import AdcloudError

__all__ = ["SimError"]


class SimError(AdcloudError):
    """A replay job is misconfigured or its infrastructure failed.

    A node under test that crashes, hangs or writes garbage is *not* an error: it is a
    failed scenario (:class:`~adcloud.sim.replay.ScenarioResult` with its reason).
    """
