"""The vLLM engine (`--rollout-engine vllm`): vLLM's OpenAI server as a rollout engine, in its own environment.

vLLM pins its own torch and transformers, so the server runs from a second Python environment
(`scripts/setup_vllm_venv.sh` makes one): a run launches one server per engine with that
environment's python (`--vllm-python`, or STACX_VLLM_PYTHON), or attaches to running ones with
`--rollout-urls`. The client speaks vLLM's own protocol (`vllm_protocol`): completions with prompt
token ids, token ids and per-token log-probs back (streamed, so that the tokens of a server killed mid-call are
kept and continued on a live engine: stacx.rollout.salvage), and the RL endpoints `/pause`, `/resume`,
`/abort_requests`. Weights go through Stacx's worker extension (`vllm_worker/stacx_vllm_worker.py`)
over `/collective_rpc`: each bucket is staged in a same-host shared-memory file (or carried in the
request, base64, for another host) and loaded in Hugging Face names with versions that only move
forward; `weight_digests` reads the loaded weights back for the post-sync check
(stacx.rollout.weight_check). docs/vllm.md has the details and what is verified where.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence
from urllib.parse import urlparse

import requests
import torch

from stacx.parallel.tensor_buckets import TENSOR_DTYPES, bucket_chunks, plan_buckets
from stacx.wire.engine import WeightBucket
from stacx.rollout.engines.processes import LocalServerGroup, stop_process
from stacx.network import is_loopback_host
from stacx.parallel.weight_broadcast import require_cuda
from stacx.rollout.engines.server_client import WEIGHT_TRANSPORTS, ServerClient
from stacx.rollout.engines.sglang import node_address
from stacx.rollout.engines.vllm_protocol import (
    build_abort_payload,
    build_completion_payload,
    build_rpc_payload,
    extend_from_chunk,
    parse_completion_response,
    parse_rpc_results,
    stream_error,
    streams,
)
from stacx.rollout.engines.vllm_weight_transfer import (
    FLAG as WEIGHT_TRANSFER_FLAG,
    TRANSFER_BACKENDS,
    TransferBackend,
    WeightTransferRefused,
    WeightTransferSession,
    weight_transfer_config_arg,
)
from stacx.wire.http_client import HttpTransport, RetryPolicy, ServerRequestError, ServerUnavailableError
from stacx.wire.types import GenerateOutput, GenerateRequest
from stacx.wire.weight_transfer import (
    SHM_FILE_PREFIX, MappedStagingFile, header_columns, numbered_buckets, shared_memory_directory
)

logger = logging.getLogger(__name__)

VLLM_PYTHON_ENV = "STACX_VLLM_PYTHON"
"""The python of the vLLM environment when --vllm-python is not given."""
EXTRA_ARGS_ENV = "STACX_VLLM_EXTRA_ARGS"
"""More `vllm serve` flags for the servers a run starts (e.g. '--max-num-seqs 64')."""
WORKER_EXTENSION = "stacx_vllm_worker.StacxWorkerExtension"
WORKER_FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_worker")
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SERVED_MODEL_NAME = "stacx-policy"
LORA_ADAPTER_NAME = SERVED_MODEL_NAME + "-lora"
"""The name a pushed LoRA adapter is served under (`--lora-sync adapters`); generation then asks for it."""
LORA_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
"""vLLM serves `/v1/load_lora_adapter` only with this set (a server started for `--lora-sync adapters` has it)."""
LORA_FOLDER_PREFIX = "stacx-lora-"
VLLM_START_TIMEOUT_S = 900.0
PAUSE_MODES = ("abort", "wait", "keep")
RPC_RETRY = RetryPolicy(timeout_s=600.0, max_attempts=1)
"""A worker-extension call is never retried: a refused bucket must surface, not be replayed."""
VLLM_WEIGHT_TRANSFERS = (*WEIGHT_TRANSPORTS, *TRANSFER_BACKENDS)
"""--vllm-weight-transfer: Stacx's buckets through the worker extension ('auto': same-host shared memory for a
loopback server, else in the request; 'shm'; 'http'), or vLLM's own weight-transfer API ('nccl'; 'gloo' on CPU:
stacx.rollout.engines.vllm_weight_transfer)."""


def vllm_python(flag_value: Optional[str] = None) -> str:
    """The vLLM environment's python: `--vllm-python`, else STACX_VLLM_PYTHON; a clear error when neither
    names an executable."""
    path = flag_value or os.environ.get(VLLM_PYTHON_ENV)
    if not path:
        raise ValueError("--rollout-engine vllm runs vLLM's server from its own Python environment: pass "
                         f"--vllm-python PATH/bin/python (or set {VLLM_PYTHON_ENV}); make one with "
                         "`scripts/setup_vllm_venv.sh` (docs/vllm.md)")
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise ValueError(f"--vllm-python {path!r} is not an executable python; make the vLLM environment with "
                         "`scripts/setup_vllm_venv.sh` (docs/vllm.md)")
    return path


class VllmEngine(ServerClient):
    """One vLLM server (use one engine per server; `EnginePool` spreads over several)."""

    def __init__(self, url: str, *, api_key: Optional[str] = None, retry: RetryPolicy = RetryPolicy(),
                 weight_transport: str = "auto", pause_mode: str = "wait", stream_progress: bool = True):
        """weight_transport: 'shm' stages buckets in a same-host shared-memory file the engine maps,
        'http' carries them in the request; 'auto' is shm for a loopback URL; 'nccl' and 'gloo' send through
        vLLM's own weight-transfer API (VLLM_WEIGHT_TRANSFERS; NCCL needs a CUDA device here). pause_mode: what
        `pause` does to in-flight requests (vLLM's /pause modes; partial rollout aborts them first itself).
        stream_progress: ask for streamed completions (the tokens as they come: `vllm_protocol.streams` says
        which requests can be; False: every request unstreamed), so a call to a server that dies raises with the
        tokens received so far (`ServerUnavailableError.partial`, one output per request, finish reason "abort"),
        which a supervised pool continues on a live engine (stacx.rollout.salvage); a request is retried until
        its answer starts, not after."""
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        if weight_transport not in VLLM_WEIGHT_TRANSFERS:
            raise ValueError(f"{WEIGHT_TRANSFER_FLAG} {weight_transport!r}: choose one of {list(VLLM_WEIGHT_TRANSFERS)}")
        self.transfer_backend: Optional[TransferBackend] = TRANSFER_BACKENDS.get(weight_transport)
        """vLLM's weight-transfer API backend the weights go through (None: Stacx's buckets)."""
        if self.transfer_backend is not None and self.transfer_backend.name == "nccl":
            require_cuda(f"{WEIGHT_TRANSFER_FLAG} nccl (on CPU use {WEIGHT_TRANSFER_FLAG} gloo, or the default, "
                         "Stacx's own buckets)")
        super().__init__(url, retry, api_key=api_key,
                         weight_transport="auto" if self.transfer_backend is not None else weight_transport)
        self._api_key = api_key
        self._rpc_transport = HttpTransport(url, RPC_RETRY, api_key=api_key)
        self.pause_mode = pause_mode
        self.stream_progress = stream_progress
        self._model: Optional[str] = None
        self._version = 0
        self._staging: Optional[_StagingFile] = None
        self._transfer: Optional[WeightTransferSession] = None
        self._lora_config: Optional[dict] = None
        self._lora_folder: Optional[str] = None
        self._fan_out = ThreadPoolExecutor(max_workers=self.max_concurrent_submissions,
                                           thread_name_prefix="VllmEngine-generate")

    # ---- generation ---------------------------------------------------------------------

    def model_name(self) -> str:
        """The name generation asks for (`GET /v1/models`, read again after each weight version check): the
        pushed LoRA adapter when the server lists one (`--lora-sync adapters`), else the served model."""
        if self._model is None:
            answer = self.transport.get("/v1/models")
            try:
                names = [card["id"] for card in answer["data"]]
                self._model = LORA_ADAPTER_NAME if LORA_ADAPTER_NAME in names else names[0]
            except (KeyError, IndexError, TypeError) as err:
                raise RuntimeError(f"{self.url}/v1/models lists no model: {str(answer)[:200]}") from err
        return self._model

    def _generate_one(self, request: GenerateRequest) -> GenerateOutput:
        version = self._version
        payload = build_completion_payload(request, model=self.model_name())
        summary = f"prompt of {len(request.input_ids)} tokens, max_tokens {request.sampling.max_new_tokens}"
        if self.stream_progress and streams(request):
            return self._generate_streamed(request, payload, summary, version)
        body = self.transport.post_json("/v1/completions", payload, summary=summary)
        return parse_completion_response(body, request, weight_version=version)

    def _generate_streamed(self, request: GenerateRequest, payload: dict, summary: str, version: int) -> GenerateOutput:
        """A streamed completion; a broken stream raises `ServerUnavailableError` whose `partial` is the tokens
        received (a one-output list)."""
        output, finished = GenerateOutput(output_ids=[], finish_reason="abort", weight_version=version), False
        try:
            for chunk in self.transport.post_events("/v1/completions", {**payload, "stream": True}, summary=summary):
                error = stream_error(chunk)
                if error is not None and 400 <= error[0] < 500:  # the request's fault, as unstreamed
                    raise ServerRequestError(f"server {self.url} rejected /v1/completions (request: {summary}): "
                                             f"HTTP {error[0]}: {error[1]}", error[0], chunk)
                if error is not None:
                    raise ServerUnavailableError(self.url, "/v1/completions", summary, 1,
                                                 f"the engine failed during the call: HTTP {error[0]}: {error[1]}")
                finished = extend_from_chunk(output, request, chunk, weight_version=version) or finished
            if not finished:
                raise ServerUnavailableError(self.url, "/v1/completions", summary, 1,
                                             "the answer ended without a finish reason")
        except ServerUnavailableError as err:
            err.partial = [output]
            raise
        return output

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        """One `/v1/completions` per request, all in flight at once (the server batches them). Streamed
        (`stream_progress`), a server that dies during the call raises one `ServerUnavailableError` whose
        `partial` has an output per request: the finished ones whole, the others with the tokens received."""
        if len(requests) <= 1:
            return [self._generate_one(r) for r in requests]
        futures = [self._fan_out.submit(self._generate_one, r) for r in requests]
        outputs, broken = [], None
        for future in futures:
            try:
                outputs.append(future.result())
            except ServerUnavailableError as err:
                partial = getattr(err, "partial", None)
                outputs.append(partial[0] if partial else GenerateOutput(output_ids=[], finish_reason="abort",
                                                                         weight_version=self._version))
                broken = broken or err
        if broken is not None:
            broken.partial = outputs
            raise broken
        return outputs

    def abort(self, rids: Optional[Sequence[str]] = None) -> None:
        self.transport.post_json("/abort_requests", build_abort_payload(rids),
                                 summary="abort every request" if rids is None else f"abort {len(rids)} request(s)")

    def pause(self) -> None:
        self.transport.post_json(f"/pause?mode={self.pause_mode}", {}, summary=f"pause ({self.pause_mode})")

    def resume(self) -> None:
        self.transport.post_json("/resume", {})

    def flush_cache(self) -> None:
        self.transport.post_json("/reset_prefix_cache", {})

    # ---- weights ------------------------------------------------------------------------

    def rpc(self, method: str, argument: Optional[dict] = None) -> list[dict]:
        """Call a Stacx worker-extension method on every worker; one answer per worker. Its own connection,
        dropped after a failure (the server closes a connection it answered 500 on, and a refused bucket
        is answered 500), so the next call never lands on a dead socket."""
        try:
            body = self._rpc_transport.post_json("/collective_rpc", build_rpc_payload(method, argument),
                                                 summary=method)
        except BaseException:
            self._rpc_transport.close()
            self._rpc_transport = HttpTransport(self.transport.url, RPC_RETRY, api_key=self._api_key)
            raise
        return parse_rpc_results(body, method)

    def weight_version(self) -> int:
        versions = {int(answer["weight_version"]) for answer in self.rpc("stacx_weight_version")}
        if len(versions) != 1:
            raise RuntimeError(f"the workers of {self.url} serve different weight versions {sorted(versions)}")
        self._version = versions.pop()
        self._model = None  # a push may have loaded an adapter since (another client of the same server)
        return self._version

    def weight_digest_dtype(self) -> torch.dtype:
        """The engine's parameter dtype: the sender digests floating tensors cast to it."""
        name = self.rpc("stacx_model_dtype")[0]["dtype"]
        if name not in TENSOR_DTYPES:
            raise RuntimeError(f"{self.url} reports model dtype {name!r}, not one of {sorted(TENSOR_DTYPES)}")
        return TENSOR_DTYPES[name]

    def weight_digests(self, names: Sequence[str]) -> dict[str, Optional[str]]:
        """{name: digest of the weight the engine holds (None: not readable)} (stacx.rollout.weight_check)."""
        digests: dict[str, Optional[str]] = {}
        for answer in self.rpc("stacx_weight_digests", {"names": list(names)}):
            for name, digest in answer["digests"].items():
                if digests.get(name) is not None and digest is not None and digests[name] != digest:
                    digests[name] = "workers-disagree"
                else:
                    digests[name] = digests.get(name) or digest
        return digests

    def use_lora_config(self, config: dict) -> None:
        """The PEFT `adapter_config.json` of the adapters this client pushes (`--lora-sync adapters`:
        `stacx.models.lora.peft_adapter_config` of the run's settings)."""
        self._lora_config = dict(config)

    def update_weights(self, buckets: Iterable[WeightBucket], *, version: int) -> None:
        """Load every bucket (numbered 0, 1, ..., the last one final) under `version`; a push of LoRA
        adapters only (PEFT names) goes through vLLM's LoRA loading instead (`load_adapters`)."""
        # Imported here: stacx.models imports megatron-core, slow to import (only a trainer rank pushes).
        from stacx.models.peft_adapters import is_adapter_tensor_name

        buckets = iter(buckets)
        first = next(buckets, None)
        if first is not None and first and all(is_adapter_tensor_name(name) for name, _ in first):
            self.load_adapters([first, *buckets], version=version)
            return
        if self.transfer_backend is not None:
            self.transfer_weights(itertools.chain([] if first is None else [first], buckets), version=version)
            return
        for index, bucket, final in numbered_buckets(itertools.chain([] if first is None else [first], buckets)):
            self._send_bucket(bucket, version=version, index=index, final=final)
        self._version = version

    def transfer_weights(self, buckets: Iterable[WeightBucket], *, version: int) -> None:
        """Send every bucket through vLLM's weight-transfer API (`transfer_backend`; the group is formed with the
        server on the first push), then record `version` as served in the worker extension. A version not newer
        than the served one, or a server started for another backend, is refused before anything is sent."""
        backend = self.transfer_backend
        served = self.weight_version()
        if version <= served:
            raise WeightTransferRefused(f"{self.url}: weight version {version} is not newer than the version the "
                                        f"engine serves ({served}); versions only move forward (a replayed or stale "
                                        "update)")
        if self._transfer is None:
            configured = self.rpc("stacx_weight_transfer")[0].get("backend")
            if configured != backend.server_backend:
                raise WeightTransferRefused(
                    f"{WEIGHT_TRANSFER_FLAG} {backend.name}: the vLLM server at {self.url} was started with "
                    f"{'weight-transfer backend ' + repr(configured) if configured else 'no weight-transfer backend'}; "
                    f"start it with {shlex.join(weight_transfer_config_arg(backend.name))} (a run that launches its "
                    f"server does), or drop {WEIGHT_TRANSFER_FLAG}")
            host = urlparse(self.url).hostname or ""
            self._transfer = WeightTransferSession(
                HttpTransport(self.url, RPC_RETRY, api_key=self._api_key), backend,
                rendezvous_host="127.0.0.1" if is_loopback_host(host) else node_address())
        self._transfer.send(buckets, version=version)
        self.rpc("stacx_transfer_finished", {"version": int(version)})
        self._version = version

    def load_adapters(self, buckets: Iterable[WeightBucket], *, version: int) -> None:
        """An adapter-only push: the adapters (PEFT names, the shared A of a fused linear sent once) written as a
        PEFT folder in this host's shared-memory folder and loaded with vLLM's `/v1/load_lora_adapter` under
        LORA_ADAPTER_NAME (in place: the name keeps its adapter id; a new folder per version, so no cached state
        of the last one is reused); the worker then serves `version`. The server reads the folder from disk: a
        server on this host only."""
        if self._lora_config is None:
            raise ValueError(f"{self.url}: a push of LoRA adapters only needs the run's adapter settings "
                             "(use_lora_config; the trainer passes them with --lora-sync adapters)")
        if self.weight_transport != "shm":
            raise ValueError(f"--lora-sync adapters with --rollout-engine vllm: vLLM loads an adapter from a folder on "
                             f"its own host, and {self.url} is not on this one; use --lora-sync merged")
        # Imported here: stacx.models imports megatron-core, slow to import (only a trainer rank pushes).
        from stacx.models.peft_adapters import peft_named_tensors, write_peft_folder

        served = self.weight_version()
        if version <= served:  # checked before loading: a stale adapter must not reach the server at all
            raise ValueError(f"{self.url}: adapter push of weight version {version} is not newer than the version the "
                             f"engine serves ({served}); versions only move forward")
        tensors = peft_named_tensors(pair for bucket in buckets for pair in bucket)
        folder = tempfile.mkdtemp(prefix=LORA_FOLDER_PREFIX, dir=shared_memory_directory())
        try:
            write_peft_folder(folder, tensors, self._lora_config)
            self.transport.post_json("/v1/load_lora_adapter",
                                     {"lora_name": LORA_ADAPTER_NAME, "lora_path": folder, "load_inplace": True},
                                     summary=f"LoRA adapter of {len(tensors)} tensors, version {version}",
                                     retry=RPC_RETRY)
            self.rpc("stacx_adapters_loaded", {"version": int(version)})
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        previous, self._lora_folder = self._lora_folder, folder
        if previous is not None:  # vLLM holds the loaded adapter in memory; the last folder is kept for a reload
            shutil.rmtree(previous, ignore_errors=True)
        self._model, self._version = LORA_ADAPTER_NAME, version

    def _send_bucket(self, bucket: WeightBucket, *, version: int, index: int, final: bool) -> None:
        slots, (num_bytes,) = plan_buckets(bucket)
        header = {**header_columns(slots), "num_bytes": num_bytes, "version": int(version), "bucket": int(index),
                  "final": bool(final)}
        if self.weight_transport == "shm":
            if self._staging is None:
                self._staging = _StagingFile()
            header["staging_path"] = self._staging.write(bucket, slots, num_bytes)
        else:
            header["body_b64"] = base64.b64encode(b"".join(bytes(c) for c in bucket_chunks(bucket, slots))).decode()
        answers = self.rpc("stacx_load_bucket", header)
        if any(answer.get("loaded") != len(bucket) for answer in answers):
            raise RuntimeError(f"{self.url}: stacx_load_bucket loaded {[a.get('loaded') for a in answers]} of "
                               f"{len(bucket)} tensors of bucket {index}, version {version}")

    def shutdown(self) -> None:
        transfer, self._transfer = self._transfer, None
        if transfer is not None:
            transfer.close()
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.close()
        folder, self._lora_folder = self._lora_folder, None
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        self._shutdown_submissions()
        self._fan_out.shutdown(wait=False, cancel_futures=True)
        self._rpc_transport.close()
        self.transport.close()

    close = shutdown


class _StagingFile(MappedStagingFile):
    """The client's same-host staging file (`stacx-weights-*` in the shared-memory folder, mode 0600):
    vLLM's server offers no staging handshake, so the sender creates it and names it in the header;
    the worker opens only such a file (stacx_vllm_worker.open_staging_file)."""

    def __init__(self):
        handle, self.path = tempfile.mkstemp(prefix=SHM_FILE_PREFIX + "vllm-", dir=shared_memory_directory())
        os.close(handle)
        self.capacity = 0
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def write(self, bucket: WeightBucket, slots, num_bytes: int) -> str:
        self.pack(bucket, slots, num_bytes)
        return self.path

    def close(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


# ---- launching ---------------------------------------------------------------------------------


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def checkpoint_dtype(hf_checkpoint: str) -> str:
    """The dtype config.json names ('dtype', else 'torch_dtype'; 'auto' when neither): vLLM's CPU build would
    otherwise serve an fp32 checkpoint in bf16, and the rollout's log-probs would not be the trainer's."""
    try:
        with open(os.path.join(hf_checkpoint, "config.json"), encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return "auto"
    dtype = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    return dtype if dtype in ("float32", "bfloat16", "float16") else "auto"


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's --max-lora-rank takes."""


def vllm_lora_args(lora_rank: int) -> list[str]:
    """`vllm serve` flags of a server that takes adapter-only pushes of rank `lora_rank` (one adapter)."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= lora_rank]
    if lora_rank < 1 or not fitting:
        raise ValueError(f"--lora-rank {lora_rank}: vLLM serves LoRA adapters of rank 1 to {VLLM_LORA_RANKS[-1]}")
    return ["--enable-lora", "--max-lora-rank", str(fitting[0]), "--max-loras", "1"]


def lora_rank_of_flags(lora_flags: Sequence[str]) -> Optional[int]:
    """The rank in a run's engine --lora-* flags (`stacx.trainer.config.run.engine_lora_flags`), None without."""
    flags = list(lora_flags)
    return int(flags[flags.index("--lora-rank") + 1]) if "--lora-rank" in flags else None


def vllm_server_command(python: str, hf_checkpoint: str, *, port: int, seed: int = 0,
                        return_routed_experts: bool = False, max_model_len: Optional[int] = None,
                        lora_rank: Optional[int] = None, weight_transfer: Optional[str] = None,
                        extra_args: Sequence[str] = ()) -> list[str]:
    """The `vllm.entrypoints.openai.api_server` command line a run starts: loopback only (vLLM's RL and RPC
    endpoints take no API key), the checkpoint's own dtype, log-probs of the sampling distribution, eager
    execution (no compilation: minutes of start-up on a CPU), vLLM's weight-transfer engine for a
    `weight_transfer` through its API (--vllm-weight-transfer nccl or gloo), then STACX_VLLM_EXTRA_ARGS and
    `extra_args`."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_checkpoint,
               "--served-model-name", SERVED_MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
               "--seed", str(seed), "--dtype", checkpoint_dtype(hf_checkpoint),
               "--logprobs-mode", "processed_logprobs", "--enforce-eager", "--optimization-level", "0",
               "--worker-extension-cls", WORKER_EXTENSION]
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    if return_routed_experts:
        command += ["--enable-return-routed-experts"]
    if lora_rank is not None:
        command += vllm_lora_args(lora_rank)
    if weight_transfer in TRANSFER_BACKENDS:
        command += weight_transfer_config_arg(weight_transfer)
    return command + shlex.split(os.environ.get(EXTRA_ARGS_ENV, "")) + list(extra_args)


def vllm_server_env(api_key: Optional[str], *, num_threads: Optional[int] = None, lora: bool = False) -> dict:
    """The server's environment: the RL and RPC endpoints on (with `lora`, the LoRA loading endpoints too), the
    worker extension importable, the secret handed over in VLLM_API_KEY (never on the command line)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_API_KEY", "STACX_API_KEY")}
    env.update(VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([WORKER_FOLDER, PROJECT_ROOT]))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if num_threads is not None:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind" if num_threads <= 0 else f"0-{num_threads - 1}")
    if api_key:
        env["VLLM_API_KEY"] = api_key
    if lora:
        env[LORA_UPDATING_ENV] = "True"
    return env


ROUTED_EXPERTS_NEED_V2_RUNNER = ("AuxOutput Connector requires Model Runner V2", "Model Runner V2 requires Triton")
"""vLLM 0.32's refusals of --enable-return-routed-experts where its V2 model runner cannot run (config/vllm.py):
only that runner captures routed experts, and it needs Triton, which vLLM's CPU build lacks."""


def start_failure_hint(log_tail: str) -> str:
    """What to do about a vLLM server that stopped before it was ready, when its log says why ('' otherwise)."""
    if any(refusal in log_tail for refusal in ROUTED_EXPERTS_NEED_V2_RUNNER):
        return (": vLLM returns routed experts only from its V2 model runner, which needs Triton (vLLM's CPU build "
                "has none), so --use-routing-replay needs a vLLM server on a GPU; drop --use-routing-replay for a "
                "CPU server (docs/vllm.md, Mixture of experts)")
    return ""


class VllmServerProcess:
    """One vLLM OpenAI server, a child process of this one; `url` once it answers /health."""

    def __init__(self, hf_checkpoint: str, *, python: str, seed: int = 0, api_key: Optional[str] = None,
                 return_routed_experts: bool = False, timeout_s: float = VLLM_START_TIMEOUT_S,
                 lora_rank: Optional[int] = None, weight_transfer: Optional[str] = None, extra_args: Sequence[str] = (),
                 wait: bool = True):
        """lora_rank: the server takes adapter-only pushes of adapters up to this rank (--lora-sync adapters).
        weight_transfer: the run's --vllm-weight-transfer (nccl or gloo start vLLM's weight-transfer engine)."""
        self.port = free_loopback_port()
        self.log_path = os.path.join(tempfile.mkdtemp(prefix="stacx-vllm-"), "server.log")
        self._log = open(self.log_path, "w")
        command = vllm_server_command(python, hf_checkpoint, port=self.port, seed=seed,
                                      return_routed_experts=return_routed_experts, lora_rank=lora_rank,
                                      weight_transfer=weight_transfer, extra_args=extra_args)
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=vllm_server_env(api_key, lora=lora_rank is not None),
                                        start_new_session=True)
        self.url: Optional[str] = None
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s = timeout_s
        if wait:
            self.wait_until_ready()

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as handle:
                return "".join(handle.readlines()[-lines:])
        except OSError:
            return ""

    def wait_until_ready(self) -> str:
        """The URL once /health answers; the server's last log lines when it exits or times out first."""
        if self.url is not None:
            return self.url
        url = f"http://127.0.0.1:{self.port}"
        while True:
            if self.process.poll() is not None:
                self.stop()
                tail = self.log_tail()
                raise RuntimeError(f"the vLLM server exited with code {self.process.returncode} before it was "
                                   f"ready{start_failure_hint(tail)}; its log ({self.log_path}) ends:\n{tail}")
            try:
                healthy = requests.get(url + "/health", timeout=2).status_code == 200
            except requests.RequestException:
                healthy = False
            if healthy:
                try:
                    self._first_forward(url)
                except BaseException as err:
                    self.stop()
                    raise RuntimeError(f"the vLLM server at {url} answered /health but failed its first request "
                                       f"({err}); its log ({self.log_path}) ends:\n{self.log_tail()}") from err
                self.url = url
                return url
            if time.monotonic() > self._deadline:
                self.stop()
                raise RuntimeError(f"the vLLM server did not become ready within {self._timeout_s:.0f}s; its log "
                                   f"({self.log_path}) ends:\n{self.log_tail()}")
            time.sleep(0.5)

    def _first_forward(self, url: str) -> None:
        """One token of one request: the first forward of a CPU server can take minutes (kernel set-up), and a
        server counts as ready once it has answered one."""
        listed = requests.get(url + "/v1/models", headers=self._headers, timeout=30)
        listed.raise_for_status()  # a server a run started takes the run's key (VLLM_API_KEY)
        model = listed.json()["data"][0]["id"]
        remaining = max(30.0, self._deadline - time.monotonic())
        answer = requests.post(url + "/v1/completions", json={"model": model, "prompt": [0], "max_tokens": 1},
                               headers=self._headers, timeout=remaining)
        answer.raise_for_status()

    def stop(self) -> None:
        """Stop the server and the engine-core processes it spawned (its own process group)."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, 15)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(timeout=10)
        stop_process(self.process, timeout_s=5)
        self._log.close()


@dataclass(eq=False)
class LaunchedVllmServers(LocalServerGroup):
    """The 'vllm' kind's servers as `LaunchedServers`."""

    processes: Sequence[VllmServerProcess]


def launch_vllm_servers(launch) -> LaunchedVllmServers:
    """One vLLM server on loopback, started without waiting (it loads while the role workers start)."""
    python = vllm_python(launch.engine_python)
    return LaunchedVllmServers([VllmServerProcess(launch.hf_checkpoint, python=python, seed=launch.seed,
                                                  api_key=launch.api_key,
                                                  return_routed_experts=launch.return_routed_experts,
                                                  lora_rank=lora_rank_of_flags(launch.lora_flags),
                                                  weight_transfer=launch.weight_transfer, wait=False)])

