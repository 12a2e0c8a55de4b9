"""How the loop reaches ranks: the `RoleGroup` protocol, its torchrun (local) and Ray implementations."""
