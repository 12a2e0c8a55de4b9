"""`stacx convert`: Hugging Face <-> megatron-core torch_dist, and training checkpoints -> Hugging Face.

    stacx convert hf-to-torch-dist --hf-checkpoint IN --tensor-model-parallel-size N --out DIR
    stacx convert torch-dist-to-hf --load DIR [--hf-checkpoint HF] --out HF_DIR
    stacx convert checkpoint-to-hf --load runs/x/step_000000004 --role policy --out HF_DIR
    stacx convert checkpoint-to-hf --load runs/x --lora adapter --out PEFT_DIR   # a LoRA run's adapters

A torch_dist folder stores global tensors and loads at any tensor-parallel size (`--ref-load` and
`--hf-checkpoint` accept it); the size given here only splits the conversion's work over that many
local processes. Every Hugging Face folder written carries the source's tokenizer files and
generation_config.json and loads with transformers' AutoTokenizer and AutoModelForCausalLM.
The `stacx-megatron-tp` format (hf-to-stacx / stacx-to-hf) is retired.
"""

from __future__ import annotations

import os
import sys
import time

HELP = "convert checkpoints: hf-to-torch-dist, torch-dist-to-hf, checkpoint-to-hf (a training step's role)"
RETIRED = ("hf-to-stacx", "stacx-to-hf")


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    to_dist = sub.add_parser("hf-to-torch-dist", help="a Hugging Face folder as megatron-core torch_dist (loads at any TP)")
    to_dist.add_argument("--hf-checkpoint", required=True, help="Hugging Face folder (config.json + safetensors)")
    to_dist.add_argument("--tensor-model-parallel-size", type=int, default=1,
                         help="local processes sharing the conversion, each reading its TP slices (default: %(default)s)")
    to_dist.add_argument("--out", required=True, help="torch_dist folder to write (new or empty)")
    to_hf = sub.add_parser("torch-dist-to-hf", help="a torch_dist folder as a Hugging Face folder")
    to_hf.add_argument("--load", required=True, help="torch_dist folder (from hf-to-torch-dist or a Megatron framework)")
    to_hf.add_argument("--hf-checkpoint", default=None,
                       help="Hugging Face folder giving config and tokenizer when --load holds no config.json")
    to_hf.add_argument("--tensor-model-parallel-size", type=int, default=1, help="local processes (default: %(default)s)")
    to_hf.add_argument("--out", required=True, help="Hugging Face folder to write (new or empty)")
    to_hf.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size (default: %(default)s)")
    step_to_hf = sub.add_parser("checkpoint-to-hf", help="one role of a training checkpoint as a Hugging Face folder")
    step_to_hf.add_argument("--load", required=True, help="a step folder (runs/x/step_000000004) or a --save folder "
                            "(its latest complete step)")
    step_to_hf.add_argument("--role", default=None, help="role to export (default: the only one, else policy/actor)")
    step_to_hf.add_argument("--hf-checkpoint", default=None,
                            help="config and tokenizer source (default: the run's own --hf-checkpoint)")
    step_to_hf.add_argument("--out", required=True, help="Hugging Face folder to write (new or empty)")
    step_to_hf.add_argument("--lora", choices=("merged", "adapter"), default=None,
                            help="a LoRA run's role: merged weights (the default) or a PEFT adapter folder "
                            "(adapter_config.json + adapter_model.safetensors) for the base model")
    for name in RETIRED:  # the old flags are accepted, so the answer is the retirement, not a flag error
        retired = sub.add_parser(name)  # no help: argparse lists a subcommand only when it has one
        for flag in ("--hf-checkpoint", "--load", "--out", "--tensor-model-parallel-size", "--max-shard-gb"):
            retired.add_argument(flag, default=None)


def _retired_message(direction: str) -> str:
    return (f"'{direction}' is retired with the stacx-megatron-tp format it wrote. Use `stacx convert hf-to-torch-dist "
            "--hf-checkpoint HF_DIR --out DIR` (megatron-core torch_dist, loads at any tensor-parallel size) and "
            "`stacx convert torch-dist-to-hf --load DIR --out HF_DIR`; a stacx-megatron-tp folder converts by way of "
            "the Hugging Face folder it came from")


def _convert(args) -> str:
    # Imported here: `stacx --help` and the other commands start without torch and megatron-core.
    from stacx.checkpointing.convert import convert_hf_to_torch_dist, convert_torch_dist_to_hf
    from stacx.trainer.checkpoint import verify_model_folder

    if args.direction == "hf-to-torch-dist":
        return convert_hf_to_torch_dist(args.hf_checkpoint, args.out, args.tensor_model_parallel_size)
    if args.direction == "torch-dist-to-hf":
        if args.tensor_model_parallel_size < 1:
            raise ValueError(f"--tensor-model-parallel-size must be >= 1, got {args.tensor_model_parallel_size}")
        verify_model_folder(args.load, flag="--load")  # a role's folder inside a training checkpoint: its manifest
        return convert_torch_dist_to_hf(args.load, args.out, hf_config=args.hf_checkpoint,
                                        tp_size=args.tensor_model_parallel_size,
                                        max_shard_bytes=int(args.max_shard_gb * 1024**3))
    from stacx.trainer.checkpoint import read_manifest, resolve_checkpoint_folder
    from stacx.trainer.checkpoint_export import base_checkpoint_of, export_role_to_hf, pick_role

    step = resolve_checkpoint_folder(args.load)
    role = pick_role(read_manifest(step), args.role)
    return export_role_to_hf(step, role, base_checkpoint_of(step, args.hf_checkpoint), args.out, lora=args.lora)


def run(args) -> int:
    from stacx.checkpointing import ModelFolderError, TorchDistCheckpointError
    from stacx.models.checkpoint import CheckpointMismatchError
    from stacx.trainer.checkpoint import CheckpointError

    if args.direction in RETIRED:
        print(f"stacx convert: error: {_retired_message(args.direction)}", file=sys.stderr)
        return 2
    start = time.monotonic()
    try:
        out = _convert(args)
    except (FileNotFoundError, FileExistsError, ValueError, CheckpointMismatchError, CheckpointError,
            ModelFolderError, TorchDistCheckpointError) as err:
        print(f"stacx convert {args.direction}: error: {err}", file=sys.stderr)
        return 2
    print(f"stacx convert {args.direction}: wrote {os.path.abspath(out)} in {time.monotonic() - start:.1f}s")
    return 0
