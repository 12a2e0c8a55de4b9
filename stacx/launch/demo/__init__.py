"""`stacx demo`: SFT -> GRPO -> on-policy distillation of a tiny model on a built-in task, on CPU."""

from stacx.launch.demo.pipeline import DemoSettings, run_demo
from stacx.launch.demo.report import format_table

__all__ = ["DemoSettings", "format_table", "run_demo"]
