"""One rank's model for one role (`RoleRuntime`), its optimizer/scheduler, value head and worker calls."""

from stacx.trainer.runtime.role_runtime import COMPUTABLE_FIELDS, RoleRuntime, role_checkpoint_path

__all__ = ["COMPUTABLE_FIELDS", "RoleRuntime", "role_checkpoint_path"]
