"""The name design document 003 gives the policy-gradient specialization (`specialization/agent.py`).

Stacx keeps it in `stacx.specializations.actor` (it trains every actor-style recipe: GRPO, GSPO, PPO's
actor, REINFORCE++, agent episodes); this module re-exports it so a reader following the document finds it.
"""

from stacx.specializations.actor import ActorSpecialization

__all__ = ["ActorSpecialization"]
