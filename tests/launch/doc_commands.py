"""Every `stacx ...` command in README.md, docs/ and examples/, as a user would copy it.

A command is read from a fenced line (or a comment line of an example) that starts with `stacx`,
its `\\` continuations joined and its trailing `# comment` dropped. Its placeholders name what a
user has after `make demo` (`substitute`): CKPT (and tiny-tool) -> the demo's SFT checkpoint, runs/x -> the demo's
GRPO run, prompts.jsonl -> the demo's prompt rows, and so on.

A command that contains `...` is a documented fragment: its flags must parse. Every other
`stacx train` command must pass `--dry-run` as written.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
from dataclasses import dataclass

COMMAND_LINE = re.compile(r"^\s*(?:#\s*|\$\s*)?(stacx\s+[a-z].*)$")


@dataclass(frozen=True)
class DocumentedCommand:
    where: str  # file:line
    text: str

    @property
    def is_fragment(self) -> bool:
        return "..." in self.text


def documented_files(repo: str) -> list[str]:
    files = [os.path.join(repo, "README.md")] + sorted(glob.glob(os.path.join(repo, "docs", "**", "*.md"), recursive=True))
    files += sorted(path for path in glob.glob(os.path.join(repo, "examples", "**", "*"), recursive=True)
                    if os.path.isfile(path))
    return files


def _strip_comment(text: str) -> str:
    return re.sub(r"\s+#.*$", "", text).strip()


def read_commands(repo: str) -> list[DocumentedCommand]:
    commands = []
    for path in documented_files(repo):
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
        in_fence = not path.endswith(".md")  # examples: every comment line counts
        index = 0
        while index < len(lines):
            line = lines[index]
            if line.lstrip().startswith("```"):
                in_fence = not in_fence
            match = COMMAND_LINE.match(line) if in_fence else None
            start = index
            if match:
                text = match.group(1)
                while _strip_comment(text).endswith("\\") and index + 1 < len(lines):
                    index += 1
                    text = _strip_comment(text)[:-1] + " " + re.sub(r"^\s*#?\s*", "", lines[index])
                where = f"{os.path.relpath(path, repo)}:{start + 1}"
                commands.append(DocumentedCommand(where, _strip_comment(text).rstrip("&").strip()))
            index += 1
    return commands


def substitute(text: str, demo: str, step: str, teacher_url: str) -> str:
    """The command with its placeholders replaced by what `stacx demo --out <demo>` wrote."""
    sft = os.path.join(demo, "checkpoints", "sft")
    grpo_hf = os.path.join(demo, "checkpoints", "grpo")
    run = os.path.join(demo, "grpo", "checkpoints")
    rows = os.path.join(demo, "builtin", "sorting")
    replacements = [
        (r"outputs/demo(?=/)", demo),
        (r"(?<![\w/])(CKPT|TEACHER|IN|<student>|<model>)(?![\w/])", sft),
        (r"--hf-checkpoint HF_DIR", f"--hf-checkpoint {sft}"),
        (r"--hf-checkpoint outputs/grpo/hf", f"--hf-checkpoint {grpo_hf}"),
        (r"--load (runs/x|runs/grpo|outputs/grpo/checkpoints)(?=[\s/]|$)", f"--load {run}"),
        (r"step_\d{9}", step),
        (r"(?<![\w/])(prompts|train|add_rows)\.jsonl", os.path.join(rows, "train.jsonl")),
        (r"--hf-checkpoint tiny-tool(?=\s|$)", f"--hf-checkpoint {sft}"),  # examples/anthropic_agent's model
        (r"(?<![\w/])heldout\.jsonl", os.path.join(rows, "eval.jsonl")),
        (r"http://127\.0\.0\.1:30000", teacher_url),
    ]
    for pattern, value in replacements:
        text = re.sub(pattern, value, text)
    return text


def write_diffusion_checkpoint(path: str) -> None:
    """A tiny SD3-style checkpoint where a documented diffusion command expects the one its previous
    command (`flow_matching_sft --save ckpt/sft`) would have saved."""
    # Imported here: diffusers and the diffusion package load only for the commands that need them.
    import torch

    from stacx.diffusion.checkpoint import save_diffusion_model
    from stacx.diffusion.config import DiffusionModelConfig
    from stacx.diffusion.models import DiffusionModel
    from stacx.diffusion.prompts import VOCABULARY

    torch.manual_seed(0)
    config = DiffusionModelConfig(family="mmdit", conditioner="text", image_size=8, attention_head_dim=8,
                                  vocabulary=VOCABULARY)
    save_diffusion_model(DiffusionModel(config), path)


def argv_of(text: str) -> list[str]:
    """The arguments after `stacx`, `[optional]` parts dropped."""
    return shlex.split(re.sub(r"\[[^\]]*\]", "", text))[1:]
