"""`stacx serve`: a CPU inference server speaking SGLang's native HTTP API subset.

    stacx serve --hf-checkpoint PATH --port 30000

Loads the Hugging Face checkpoint into Stacx's own megatron-core model (the trainer's model
definition), and serves /generate with per-token log-probs, weight updates, pause/resume,
flush_cache and health (see stacx.rollout.server). Use it as the CPU rollout engine or as a
frozen teacher for distillation.
"""

from __future__ import annotations

HELP = "serve a checkpoint on CPU through SGLang's /generate API (rollout engine or teacher)"


def add_arguments(parser) -> None:
    parser.add_argument("--hf-checkpoint", required=True, help="folder with config.json and safetensors weights")
    parser.add_argument("--port", type=int, default=30000, help="TCP port (0 picks a free one; default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler for requests without their own")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="parameter dtype")


def run(args) -> int:
    import os

    import torch

    from stacx.rollout.cpu_engine import CpuEngine
    from stacx.rollout.server import EngineHttpServer

    if not os.path.isfile(os.path.join(args.hf_checkpoint, "config.json")):
        raise SystemExit(f"--hf-checkpoint {args.hf_checkpoint}: no config.json in that folder")
    engine = CpuEngine.from_hf_checkpoint(args.hf_checkpoint, params_dtype=getattr(torch, args.dtype), seed=args.seed)
    server = EngineHttpServer(engine, host=args.host, port=args.port, model_path=args.hf_checkpoint)
    print(f"stacx serve: {args.hf_checkpoint} at {server.url} (ready)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0
