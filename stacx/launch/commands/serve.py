"""`stacx serve`: a CPU inference server speaking SGLang's native HTTP API subset.

    stacx serve --hf-checkpoint PATH --port 30000

Loads the Hugging Face checkpoint into Stacx's own megatron-core model (the trainer's model
definition), and serves /generate with per-token log-probs, weight updates, pause/resume,
flush_cache and health (see stacx.serving.server). Use it as the CPU rollout engine or as a
frozen teacher for distillation.

Weight updates, pause, continue and flush need the `--api-key` secret (or `STACX_API_KEY`),
required whenever `--host` is not a loopback address. Without one, the server generates a random
key, writes it to a mode-0600 file (`--api-key-file`) and prints where; `--no-weight-updates`
serves a frozen model (a teacher) with no key and no weight endpoints. SIGTERM and Ctrl-C stop
the server and remove its shared-memory staging files and its generated key file.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from typing import NoReturn

from stacx.network import is_loopback_host, private_file_path, write_private_file

from stacx.wire.http_client import API_KEY_ENV

HELP = "serve a checkpoint on CPU through SGLang's /generate API (rollout engine or teacher)"

LIMIT_HELP = {
    "max_body_bytes": "largest JSON request body; larger ones get 413",
    "max_weight_body_bytes": "largest weight-bucket body",
    "read_timeout_s": "longest wait for a client's bytes, and for a whole JSON body",
    "keep_alive_timeout_s": "an idle keep-alive connection closes after this long",
    "max_connections": "connections open at once; at the cap the longest-idle one is closed for a new one, and "
                       "only when all are busy does one more get 503",
    "max_requests_per_client": "requests one client address may have in flight; more get 503",
    "max_queued_requests": "/generate calls running or waiting at once; more get 503",
    "stall_timeout_s": "/health answers 503 when generation made no progress this long",
    "max_chars_per_token": "a request's text longer than this many characters per token of the model's context "
                           "is refused (400) before it is tokenized",
}
"""The help of each `ServerLimits` field's flag (`--max-body-bytes` for `max_body_bytes`)."""


def add_arguments(parser) -> None:
    # Imported here: the HTTP stack is slow to import (`stacx --help` stays fast).
    from stacx.launch.run_flags import flag_name
    from stacx.serving.http_guard import ServerLimits

    limits = ServerLimits()
    parser.add_argument("--hf-checkpoint", required=True, help="folder with config.json and safetensors weights")
    parser.add_argument("--port", type=int, default=30000, help="TCP port (0 picks a free one; default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: %(default)s); any non-loopback address needs --api-key")
    parser.add_argument("--api-key", default=None,
                        help="shared secret required (as 'Authorization: Bearer KEY') by weight updates, pause, "
                             f"continue and flush; default: the {API_KEY_ENV} environment variable, which keeps "
                             "the key out of the process list, else a generated key written to --api-key-file")
    parser.add_argument("--api-key-file", default=None,
                        help="where a generated key is written (mode 0600; removed when the server stops); "
                             "default: stacx-serve-PORT.key in $XDG_RUNTIME_DIR, else in a private stacx-UID "
                             "folder of the temp folder")
    parser.add_argument("--no-weight-updates", action="store_true",
                        help="serve a frozen model (a teacher): the weight endpoints are refused and no key is "
                             "needed or generated (without --api-key, pause, continue and flush are refused too)")
    parser.add_argument("--parent-pid", type=int, default=None,
                        help="stop (removing the shared-memory staging files) when the process with this id ends; "
                             "the trainer passes its own so a killed driver leaves no server behind. Such a server "
                             "ignores SIGINT (a Ctrl-C reaches the driver, which stops it)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampler for requests without their own")
    parser.add_argument("--bind-cores", default=None, metavar="CORES",
                        help="pin the engine's torch threads one to a core, e.g. 0-1 (as many threads as cores; what "
                             "vLLM's VLLM_CPU_OMP_THREADS_BIND does): faster when the server has these cores to itself. "
                             "Default: not pinned, right when other engines or a trainer share the machine")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="parameter dtype")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="take a LoRA run's adapters only (its --lora-sync adapters): the rank of its adapters, "
                             "merged into the weights on each update (default: 0, full weight updates)")
    parser.add_argument("--lora-alpha", type=float, default=16.0, help="the run's --lora-alpha (default: %(default)s)")
    parser.add_argument("--lora-rslora", action="store_true",
                        help="the run's --lora-rslora: the adapters are scaled by alpha / sqrt(rank)")
    parser.add_argument("--lora-target-modules", action="append", default=None, metavar="NAME",
                        help="the run's --lora-target-modules, repeatable (default: all-linear)")
    for field in dataclasses.fields(ServerLimits):  # one flag per limit, named, typed and defaulted by its field
        default = getattr(limits, field.name)
        parser.add_argument(flag_name(field.name), type=type(default), default=default,
                            help=f"{LIMIT_HELP[field.name]} (default: %(default)s)")


def resolve_api_key(args) -> str | None:
    """--api-key, else STACX_API_KEY; refuses a non-loopback --host without one (SystemExit naming the flag)."""
    api_key = args.api_key if args.api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    if args.api_key is not None and not args.api_key:
        raise SystemExit("--api-key is empty; give a secret (e.g. python -c 'import secrets; print(secrets.token_urlsafe())')")
    if api_key is None and not is_loopback_host(args.host):
        raise SystemExit(
            f"--host {args.host} is reachable from other machines, so weight updates, pause and flush need a secret: "
            f"pass --api-key KEY (or set {API_KEY_ENV}), or bind --host 127.0.0.1")
    return api_key


def build_limits(args):
    # Imported here: the HTTP stack is slow to import (`stacx --help` stays fast).
    from stacx.launch.run_flags import flag_name
    from stacx.serving.http_guard import ServerLimits

    try:
        return ServerLimits(**{field.name: getattr(args, field.name) for field in dataclasses.fields(ServerLimits)})
    except ValueError as err:  # ServerLimits.<field> -> the flag
        field = str(err).split(" ", 1)[0].removeprefix("ServerLimits.")
        raise SystemExit(f"{flag_name(field)}: {err}") from None


def parse_bind_cores(text: str | None) -> tuple[int, ...] | None:
    """--bind-cores as core ids (None when not given); SystemExit naming the flag when they are not usable here."""
    if text is None:
        return None
    from stacx.serving.cpu_threads import check_cores_available, parse_core_list

    try:
        cores = parse_core_list(text)
    except ValueError as err:
        raise SystemExit(f"--bind-cores: {err}") from None
    try:
        check_cores_available(cores)
    except ValueError as err:
        raise SystemExit(f"--bind-cores {text}: {err}; name cores from that list") from None
    return cores


def default_api_key_file(port: int) -> str:
    """stacx-serve-PORT.key in $XDG_RUNTIME_DIR (private to the user), else in a stacx-UID folder of
    the temp folder, created mode 0700 and refused when another user made it first."""
    try:
        return private_file_path(f"stacx-serve-{port}.key")
    except PermissionError as err:
        raise SystemExit(f"stacx serve: {err}; pass --api-key-file PATH or --api-key") from None


def write_api_key_file(path: str, api_key: str) -> str:
    """Write the key to `path`, mode 0600, atomically (a new file renamed over the name, so a link
    planted there is replaced, never followed). Returns the absolute path."""
    try:
        return write_private_file(path, api_key)
    except OSError as err:
        raise SystemExit(f"stacx serve: cannot write the generated API key to {os.path.abspath(path)} ({err}); pass "
                         "--api-key-file PATH in a folder you own, or --api-key") from None


def watch_parent(parent_pid: int) -> None:
    """SIGTERM this server once `parent_pid` is gone (the kernel's parent-death signal when it is the
    parent, and a watch thread), so its normal shutdown removes its files even after a SIGKILLed driver;
    SIGKILL if it is still there `TEARDOWN_GRACE_S` later. The server a run started ignores SIGINT: a
    Ctrl-C reaches the driver's whole process group (torchrun signals a rank's group), and the driver
    stops its server itself once it no longer needs it (its teardown releases staging files first)."""
    from stacx.trainer.lifetime import end_with_parent

    try:
        end_with_parent(parent_pid)
    except ProcessLookupError:
        raise SystemExit(f"--parent-pid {parent_pid}: no such process") from None
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def load_tokenizer_if_saved(path: str):
    """The checkpoint folder's tokenizer, or None (then /generate takes token ids only) with a note."""
    from stacx.models.saved_tokenizer import load_saved_tokenizer

    try:
        return load_saved_tokenizer(path)
    except Exception as err:  # noqa: BLE001 - transformers raises several types for a missing tokenizer
        print(f"stacx serve: no tokenizer in {path} ({type(err).__name__}); /generate takes 'input_ids' only "
              "and answers carry no text", flush=True)
        return None


def run(args) -> int:
    # The flags are checked first: a refused start costs no model imports.
    api_key = resolve_api_key(args)
    limits = build_limits(args)
    bind_cores = parse_bind_cores(args.bind_cores)
    # Imported here: torch, megatron-core and the HTTP stack are slow to import (`stacx --help` stays fast).
    import torch

    from stacx.models.checkpoint import CheckpointNotFoundError, require_hf_checkpoint_folder
    from stacx.serving.cpu_engine import CpuEngine
    from stacx.serving.server import EngineHttpServer

    try:
        require_hf_checkpoint_folder(args.hf_checkpoint)
    except CheckpointNotFoundError as err:
        raise SystemExit(f"stacx serve: {err}") from None
    from stacx.backend_warnings import print_cpu_path_notice

    if args.parent_pid is None:  # a server a run started: its driver printed the line already
        print_cpu_path_notice()
    lora = None
    if args.lora_rank > 0:
        from stacx.models.lora import LoraSettings

        try:
            lora = LoraSettings(rank=args.lora_rank, alpha=args.lora_alpha, rslora=args.lora_rslora,
                                target_modules=tuple(args.lora_target_modules or ("all-linear",)))
        except ValueError as err:
            raise SystemExit(f"stacx serve: {err}") from None
    engine = CpuEngine.from_hf_checkpoint(args.hf_checkpoint, params_dtype=getattr(torch, args.dtype), seed=args.seed,
                                          lora=lora, bind_cores=bind_cores)
    server = EngineHttpServer(engine, host=args.host, port=args.port, model_path=args.hf_checkpoint,
                              api_key=api_key, weight_updates=not args.no_weight_updates, limits=limits,
                              tokenizer=load_tokenizer_if_saved(args.hf_checkpoint))
    key_file = None
    if api_key is None and server.api_key is not None:
        try:
            key_file = write_api_key_file(args.api_key_file or default_api_key_file(server.port), server.api_key)
        except BaseException:
            server.close()
            raise
        print(f"stacx serve: no --api-key given; weight updates, pause, continue and flush need the generated key "
              f"in {key_file} (mode 0600), e.g. {API_KEY_ENV}=$(cat {key_file})", flush=True)

    def stop_on_sigterm(signum, frame):  # the trainer's teardown: leave no staging file behind
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_on_sigterm)
    if args.parent_pid is not None:
        watch_parent(args.parent_pid)
    try:
        server.start()
        print(f"stacx serve: {args.hf_checkpoint} at {server.url} (ready)", flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        if key_file is not None:
            remove_quietly(key_file)
    exit_without_teardown(0)


def exit_without_teardown(code: int) -> NoReturn:
    """End this process with `code` once the server stopped and removed its files: the exit handlers run
    and both streams are flushed, then the interpreter's teardown is skipped (freeing torch's and
    megatron-core's modules and objects: seconds of CPU, 3-6 s before the process is gone on a busy machine,
    which every run's teardown waited for)."""
    import atexit
    import sys

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to flush into it
            pass
    os._exit(code)


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
