"""Built-in tasks (`prompt_data: builtin:<task>`), their datasets and tiny checkpoints."""

from stacx.tasks.builtin import TASKS, BuiltinTask, get_task, register_task, sample_examples
from stacx.tasks.checkpoint import write_tiny_checkpoint, write_tiny_moe_checkpoint, write_tiny_tool_checkpoint
from stacx.tasks.data import is_builtin, parse_builtin_spec, resolve_data_path, task_rows

__all__ = [
    "TASKS", "BuiltinTask", "get_task", "register_task", "sample_examples", "write_tiny_checkpoint",
    "write_tiny_moe_checkpoint", "write_tiny_tool_checkpoint",
    "is_builtin", "parse_builtin_spec", "resolve_data_path", "task_rows",
]
