"""One rank's model for one role (`RoleRuntime`), its optimizer/scheduler, value head and worker calls."""

from stacx.trainer.runtime.role_runtime import COMPUTABLE_FIELDS, RoleRuntime

__all__ = ["COMPUTABLE_FIELDS", "RoleRuntime"]
