"""`stacx convert`: Hugging Face checkpoints to Stacx TP-sharded model folders and back.

    stacx convert hf-to-stacx --hf-checkpoint IN --tensor-model-parallel-size N --out DIR
    stacx convert stacx-to-hf --load DIR --out HF_DIR

Both run in one process from the config alone: each TP shard reads only its slices of the
Hugging Face tensors, and the export loads with transformers.AutoModelForCausalLM.from_pretrained.
"""

from __future__ import annotations

import os
import sys
import time

HELP = "convert checkpoints: hf-to-stacx (shard for a TP size) or stacx-to-hf (merge for transformers)"


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    to_stacx = sub.add_parser("hf-to-stacx", help="shard a Hugging Face checkpoint for a tensor-parallel size")
    to_stacx.add_argument("--hf-checkpoint", required=True, help="Hugging Face folder (config.json + safetensors)")
    to_stacx.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size (default: %(default)s)")
    to_stacx.add_argument("--out", required=True, help="Stacx model folder to write")
    to_hf = sub.add_parser("stacx-to-hf", help="merge a Stacx model folder into a Hugging Face checkpoint")
    to_hf.add_argument("--load", required=True, help="Stacx model folder (written by hf-to-stacx or a trainer)")
    to_hf.add_argument("--out", required=True, help="Hugging Face folder to write")
    to_hf.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size (default: %(default)s)")


def _validate(args) -> str | None:
    """An error message for a user mistake, or None."""
    if args.direction == "hf-to-stacx":
        if args.tensor_model_parallel_size < 1:
            return f"--tensor-model-parallel-size must be >= 1, got {args.tensor_model_parallel_size}"
        if not os.path.isfile(os.path.join(args.hf_checkpoint, "config.json")):
            return f"--hf-checkpoint: no config.json in {args.hf_checkpoint}"
    elif not os.path.isdir(args.load):
        return f"--load: folder {args.load} does not exist"
    return None


def run(args) -> int:
    from stacx.models.checkpoint import CheckpointMismatchError
    from stacx.models.stacx_checkpoint import convert_hf_to_stacx, convert_stacx_to_hf

    message = _validate(args)
    if message is None:
        start = time.monotonic()
        try:
            if args.direction == "hf-to-stacx":
                convert_hf_to_stacx(args.hf_checkpoint, args.out, args.tensor_model_parallel_size)
            else:
                convert_stacx_to_hf(args.load, args.out, max_shard_bytes=int(args.max_shard_gb * 1024**3))
        except (FileNotFoundError, ValueError, CheckpointMismatchError) as err:
            message = str(err)
        else:
            print(f"stacx convert {args.direction}: wrote {os.path.abspath(args.out)} in {time.monotonic() - start:.1f}s")
            return 0
    print(f"stacx convert {args.direction}: error: {message}", file=sys.stderr)
    return 2
