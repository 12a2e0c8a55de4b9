"""Asynchronous rollout: the scheduler of in-flight samples across weight versions and the
`AsyncRollout` that drives it (partial rollout). See docs/rollout.md."""
