"""The SGLang engine for GPU clusters: launch (or attach to) SGLang servers, update their weights.

Generation, pause/resume, flush and health are `HttpEngine`'s (SGLang's native API); a run's client streams
`/generate` in SGLang's own event format (stacx.wire.sglang_stream), so the tokens of a server that dies
mid-answer are kept and continued on a live one. Weights go
one of two ways (field names from SGLang's io_struct, see docs/sglang.md):

- colocated (`weight_update="tensor"`): `POST /update_weights_from_tensor` with
  `{"serialized_named_tensors": [one entry per SGLang TP rank], "load_format", "flush_cache",
  "weight_version"}`; each entry is SGLang's `MultiprocessingSerializer` string of the bucket's
  (name, tensor) list (CUDA tensors travel as IPC handles, no copy).
- separate GPUs (`weight_update="distributed"`): once, `POST /init_weights_update_group`
  `{"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}`
  while the trainer joins the same group as rank 0 (`WeightBroadcastGroup`); then per bucket
  `POST /update_weights_from_distributed` `{"names", "dtypes", "shapes", "group_name",
  "flush_cache", "weight_version"}` and, concurrently, one broadcast per tensor from rank 0.

A push of LoRA adapters only (`--lora-sync adapters`: every tensor a PEFT `lora_A` / `lora_B`) goes through
SGLang's LoRA API instead: `POST /load_lora_adapter_from_tensors` `{"lora_name", "config_dict",
"serialized_tensors", "load_format"}` (the adapters in PEFT's names, serialized as a dict by the same serializer)
under a name per version (`stacx-policy-lora-v{version}`: a reused name may keep serving its old weights), then
`POST /update_weight_version` `{"new_version", "abort_all_requests"}` and `POST /unload_lora_adapter`
`{"lora_name"}` of the previous version's adapter. Generation names the adapter in `/generate`'s `lora_path`;
a client that did not push (the driver's) finds it in `GET /v1/models`, which lists the loaded adapters, after
each weight version check. The server must be started with `--enable-lora`, `--max-lora-rank` and
`--lora-target-modules` (`sglang_lora_args`).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

from stacx.parallel.tensor_buckets import dtype_name
from stacx.parallel.weight_broadcast import WeightBroadcastGroup
from stacx.rollout.engines.http import HttpEngine, summarize_requests
from stacx.rollout.engines.processes import stop_process
from stacx.rollout.engines.streamed_generate import generate_sglang_streamed, sglang_streams
from stacx.wire.engine import WeightBucket
from stacx.wire.http_client import RetryPolicy
from stacx.wire.sglang_protocol import build_generate_payload, parse_generate_response
from stacx.wire.types import GenerateOutput, GenerateRequest

WEIGHT_UPDATE_MODES = ("tensor", "distributed")
LORA_ADAPTER_PREFIX = "stacx-policy-lora-v"
"""An adapter-only push of version N is served under `stacx-policy-lora-vN`."""


def build_update_from_tensor_payload(serialized_per_rank: Sequence[str], *, version: int, final: bool) -> dict:
    return {
        "serialized_named_tensors": list(serialized_per_rank),
        "load_format": None,
        "flush_cache": bool(final),
        "weight_version": str(version),
    }


def build_update_from_distributed_payload(bucket: WeightBucket, *, group_name: str, version: int, final: bool) -> dict:
    return {
        "names": [name for name, _ in bucket],
        "dtypes": [dtype_name(t.dtype, name) for name, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
        "flush_cache": bool(final),
        "weight_version": str(version),
    }


def build_load_lora_from_tensors_payload(serialized: str, *, lora_name: str, config: dict) -> dict:
    return {"lora_name": lora_name, "config_dict": dict(config), "serialized_tensors": serialized, "load_format": None}


def build_update_weight_version_payload(version: int) -> dict:
    return {"new_version": str(version), "abort_all_requests": False}


def sglang_lora_args(lora_flags: Sequence[str]) -> list[str]:
    """`sglang.launch_server` flags of a server that takes adapter-only pushes with a run's engine --lora-* flags
    (`stacx.trainer.config.run.engine_lora_flags`): rank and Hugging Face target modules are fixed at start-up."""
    # Imported here: stacx.models imports megatron-core, slow to import (a launcher needs only these names).
    from stacx.models.peft_adapters import hf_target_modules

    flags = list(lora_flags)
    targets = [flags[i + 1] for i, flag in enumerate(flags) if flag == "--lora-target-modules"] or ["all-linear"]
    return ["--enable-lora", "--max-lora-rank", flags[flags.index("--lora-rank") + 1], "--max-loras-per-batch", "1",
            "--lora-target-modules", *hf_target_modules(targets)]


def build_init_group_payload(*, master_address: str, master_port: int, rank_offset: int, world_size: int,
                             group_name: str, backend: str) -> dict:
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def default_serializer() -> Callable[[list], str]:
    """SGLang's own serializer (imported only when the tensor path is used on a GPU node)."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError as err:
        raise ImportError("weight_update='tensor' needs the sglang package (pip install 'stacx[sglang]')") from err
    return lambda named_tensors: MultiprocessingSerializer.serialize(named_tensors, output_str=True)


WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True, kw_only=True)
class SglangServerSpec:
    """How to launch one SGLang server."""

    model_path: str
    port: int
    host: Optional[str] = None
    """Address to bind; None binds the address of the node it runs on, the one the trainer uses
    (Ray's node IP, loopback outside Ray). A wildcard (0.0.0.0, ::) is refused."""
    api_key: Optional[str] = None
    """SGLang's `--api-key`: the shared secret its clients send as a bearer token (the trainer
    generates one per run)."""
    tensor_model_parallel_size: int = 1
    mem_fraction_static: float = 0.7
    extra_args: tuple[str, ...] = ()

    def __post_init__(self):
        if self.host in WILDCARD_HOSTS:
            raise ValueError(f"SglangServerSpec.host {self.host!r} would serve on every interface; leave it None "
                             "(the node's own address) or name one address")
        if self.api_key is not None and not self.api_key:
            raise ValueError("SglangServerSpec.api_key is empty; pass None or a secret")
        if any(arg in ("--host", "--api-key") for arg in self.extra_args):
            raise ValueError("SglangServerSpec.extra_args: set --host and --api-key through the spec's "
                             "'host' and 'api_key' fields")


def node_address() -> str:
    """The address of this node as the trainer reaches it: Ray's node IP inside a Ray worker or
    driver, else loopback (a single-machine run)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def build_launch_command(spec: SglangServerSpec, host: Optional[str] = None) -> list[str]:
    """The `sglang.launch_server` command line, bound to `host` (default: the spec's host, else
    `node_address()`); with an api_key, SGLang itself requires it on every endpoint."""
    host = host or spec.host or node_address()
    command = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", spec.model_path, "--host", host,
        "--port", str(spec.port), "--tp-size", str(spec.tensor_model_parallel_size),
        "--mem-fraction-static", str(spec.mem_fraction_static), "--skip-server-warmup",
    ]
    if spec.api_key:
        command += ["--api-key", spec.api_key]
    return command + list(spec.extra_args)


class SglangServerProcess:
    """Runs `python -m sglang.launch_server` and waits for /health (wrap in a Ray actor to place it)."""

    def __init__(self, spec: SglangServerSpec, *, startup_timeout_s: float = 900.0):
        self.spec = spec
        host = spec.host or node_address()
        self.process = subprocess.Popen(build_launch_command(spec, host))
        url = f"http://{host}:{spec.port}"
        probe = HttpEngine(url, RetryPolicy(timeout_s=10, max_attempts=max(1, int(startup_timeout_s // 5)),
                                            backoff_s=5, backoff_max_s=5), api_key=spec.api_key)
        try:
            probe.transport.get("/health")
        except Exception as err:
            self.stop()
            raise RuntimeError(f"SGLang server {url} ({spec.model_path}) did not become healthy: {err}") from err
        self.url = url

    def stop(self) -> None:
        stop_process(self.process, timeout_s=60)


SGLANG_SCHEDULING_MARGIN_S = 120.0
"""Time on top of the server's own startup timeout for Ray to place the actor."""


def launch_sglang_servers_on_ray(specs: Sequence[SglangServerSpec], *, num_gpus_per_server: Optional[int] = None,
                                 startup_timeout_s: float = 900.0, pin_to_host: bool = False):
    """One Ray actor per server on the rollout GPUs; returns (actors, urls). Needs a Ray cluster with GPUs.
    pin_to_host: place each actor on the node of its spec's host (Ray's `node:<address>` resource; a restart).

    Fails (instead of waiting forever) when the servers are not up within startup_timeout_s plus a
    scheduling margin, e.g. because the cluster lacks the GPUs; every actor started is killed first.
    """
    # Imported here: Ray is slow to import (start-up time).
    import ray

    actor_cls = ray.remote(SglangServerProcess)
    actors = []
    try:
        for spec in specs:
            num_gpus = num_gpus_per_server or spec.tensor_model_parallel_size
            placement = {"resources": {f"node:{spec.host}": 0.001}} if pin_to_host and spec.host else {}
            actors.append(actor_cls.options(num_gpus=num_gpus, **placement).remote(spec,
                                                                                  startup_timeout_s=startup_timeout_s))
        wait_s = startup_timeout_s + SGLANG_SCHEDULING_MARGIN_S
        try:
            urls = ray.get([a.__ray_call__.remote(lambda self: self.url) for a in actors], timeout=wait_s)
        except ray.exceptions.GetTimeoutError as err:
            needs = ", ".join(f"{s.model_path}: {num_gpus_per_server or s.tensor_model_parallel_size} GPU(s)" for s in specs)
            raise RuntimeError(f"SGLang servers were not ready within {wait_s:.0f}s ({needs}); "
                               "does the Ray cluster have these GPUs free?") from err
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        raise
    return actors, urls


class SglangEngine(HttpEngine):
    """An attached SGLang server (one URL; use one engine per server and a router for many)."""

    def __init__(self, url: str, *, weight_update: str = "tensor", retry: RetryPolicy = RetryPolicy(),
                 serializer: Optional[Callable[[list], str]] = None, server_tp_size: Optional[int] = None,
                 broadcast_group: Optional[WeightBroadcastGroup] = None, group_name: str = "weight_update_group",
                 api_key: Optional[str] = None, stream_progress: bool = False):
        """api_key: the server's `--api-key` (None: `STACX_API_KEY` if set). server_tp_size: the server's
        TP degree, one serialized entry per TP rank on the tensor path (None: the server's own
        `tp_size`, read once from `GET /get_server_info`). stream_progress: ask for SGLang's streamed `/generate`
        (the tokens as they come, `sglang_streams` says which requests can be), so a call to a server that dies
        raises with the tokens received so far (stacx.rollout.engines.streamed_generate); a run's client streams
        (`stacx.rollout.engines.registry`)."""
        if weight_update not in WEIGHT_UPDATE_MODES:
            raise ValueError(f"weight_update must be one of {WEIGHT_UPDATE_MODES}, got {weight_update!r}")
        if not isinstance(stream_progress, bool):
            raise ValueError(f"SglangEngine: stream_progress must be True or False, got {stream_progress!r}")
        super().__init__(url, retry, api_key=api_key, stream_progress=stream_progress)
        self.weight_update = weight_update
        self._serializer = serializer
        self.server_tp_size = server_tp_size
        self.broadcast_group = broadcast_group
        self.group_name = group_name
        self._version = 0
        self._lora_config: Optional[dict] = None
        self._lora_name: Optional[str] = None
        """The adapter generation asks for (`lora_path`), None: the base model."""

    def init_weight_update_group(self, *, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 backend: str = "nccl") -> WeightBroadcastGroup:
        """Ask the server to join the group while the trainer joins as rank 0 (both block until all joined)."""
        payload = build_init_group_payload(master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                                           world_size=world_size, group_name=self.group_name, backend=backend)
        with ThreadPoolExecutor(max_workers=1) as pool:
            answer = pool.submit(self.transport.post_json, "/init_weights_update_group", payload,
                                 summary=f"join {self.group_name} at {master_address}:{master_port}")
            group = WeightBroadcastGroup(master_address=master_address, master_port=master_port,
                                         world_size=world_size, backend=backend)
            _check_success(answer.result(), "/init_weights_update_group")
        self.broadcast_group = group
        return group

    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateOutput]:
        """One batched `/generate` (naming the pushed adapter, if any); streamed when `stream_progress` and every
        request can be (`sglang_streams`)."""
        if not requests:
            return []
        payload = build_generate_payload(requests)
        if self._lora_name is not None:
            payload["lora_path"] = [self._lora_name] * len(requests)
        summary = summarize_requests(requests)
        if self.stream_progress and all(sglang_streams(r) for r in requests):
            return generate_sglang_streamed(self.transport, requests, payload, summary=summary)
        body = self.transport.post_json("/generate", payload, summary=summary)
        return parse_generate_response(body, requests)

    def use_lora_config(self, config: dict) -> None:
        """The PEFT `adapter_config.json` of the adapters this client pushes (`--lora-sync adapters`)."""
        self._lora_config = dict(config)

    def update_weights(self, buckets: Iterable[WeightBucket], *, version: int) -> None:
        # Imported here: stacx.models imports megatron-core, slow to import (only a trainer rank pushes).
        from stacx.models.peft_adapters import is_adapter_tensor_name

        buckets = list(buckets)
        if not buckets:
            raise ValueError("update_weights: no buckets given")
        if all(is_adapter_tensor_name(name) for bucket in buckets for name, _ in bucket):
            self.load_adapters(buckets, version=version)
            return
        for index, bucket in enumerate(buckets):
            final = index == len(buckets) - 1
            if self.weight_update == "tensor":
                self._update_from_tensor(bucket, version=version, final=final)
            else:
                self._update_from_distributed(bucket, version=version, final=final)
        self._version = version

    def load_adapters(self, buckets: Iterable[WeightBucket], *, version: int) -> None:
        """An adapter-only push through SGLang's LoRA API (module doc): load version `version`'s adapter, report
        the version, unload the previous one."""
        if self._lora_config is None:
            raise ValueError(f"{self.url}: a push of LoRA adapters only needs the run's adapter settings "
                             "(use_lora_config; the trainer passes them with --lora-sync adapters)")
        # Imported here: stacx.models imports megatron-core, slow to import (only a trainer rank pushes).
        from stacx.models.peft_adapters import peft_named_tensors

        tensors = peft_named_tensors(pair for bucket in buckets for pair in bucket)
        if torch.cuda.is_available():  # SGLang's ranks open CUDA IPC handles, as on the weight path
            tensors = {name: tensor.cuda() for name, tensor in tensors.items()}
        name = f"{LORA_ADAPTER_PREFIX}{int(version)}"
        serialize = self._serializer or default_serializer()
        answer = self.transport.post_json("/load_lora_adapter_from_tensors",
                                          build_load_lora_from_tensors_payload(serialize(tensors), lora_name=name,
                                                                               config=self._lora_config),
                                          summary=f"LoRA adapter {name} of {len(tensors)} tensors")
        _check_success(answer, "/load_lora_adapter_from_tensors")
        _check_success(self.transport.post_json("/update_weight_version", build_update_weight_version_payload(version),
                                                summary=f"weight version {version}"), "/update_weight_version")
        previous, self._lora_name, self._version = self._lora_name, name, version
        if previous is not None and previous != name:
            _check_success(self.transport.post_json("/unload_lora_adapter", {"lora_name": previous},
                                                    summary=f"unload {previous}"), "/unload_lora_adapter")

    def _served_adapter(self) -> Optional[str]:
        """The newest `stacx-policy-lora-vN` that `GET /v1/models` lists, None when it lists none."""
        answer = self.transport.get("/v1/models")
        cards = answer.get("data") if isinstance(answer, dict) else None
        names = [card.get("id") for card in cards or () if isinstance(card, dict)]
        suffixes = [n[len(LORA_ADAPTER_PREFIX):] for n in names if isinstance(n, str) and n.startswith(LORA_ADAPTER_PREFIX)]
        versions = [int(suffix) for suffix in suffixes if suffix.isdigit()]
        return f"{LORA_ADAPTER_PREFIX}{max(versions)}" if versions else None

    def _update_from_tensor(self, bucket: WeightBucket, *, version: int, final: bool) -> None:
        serialize = self._serializer or default_serializer()
        # CUDA IPC handles (no copy) are what SGLang's ranks open; a bucket gathered to the CPU goes to this GPU first.
        named = [(name, tensor.cuda()) for name, tensor in bucket] if torch.cuda.is_available() else list(bucket)
        serialized = serialize(named)
        payload = build_update_from_tensor_payload([serialized] * self._tensor_parallel_size(), version=version,
                                                   final=final)
        answer = self.transport.post_json("/update_weights_from_tensor", payload,
                                          summary=f"{len(bucket)} tensors, version {version}")
        _check_success(answer, "/update_weights_from_tensor")

    def _tensor_parallel_size(self) -> int:
        """The server's TP degree: each of its TP ranks reads its own entry of `serialized_named_tensors`."""
        if self.server_tp_size is None:
            info = self.transport.get("/get_server_info")
            tp_size = info.get("tp_size") if isinstance(info, dict) else None
            if not isinstance(tp_size, int) or tp_size < 1:
                raise RuntimeError(f"{self.url}/get_server_info reports no 'tp_size' (got {str(info)[:200]}); "
                                   "pass SglangEngine(server_tp_size=N), the server's --tp-size")
            self.server_tp_size = tp_size
        return self.server_tp_size

    def _update_from_distributed(self, bucket: WeightBucket, *, version: int, final: bool) -> None:
        if self.broadcast_group is None:
            raise RuntimeError("weight_update='distributed' needs init_weight_update_group() first")
        payload = build_update_from_distributed_payload(bucket, group_name=self.group_name, version=version, final=final)
        errors = []

        def post():
            try:
                _check_success(self.transport.post_json("/update_weights_from_distributed", payload,
                                                        summary=f"{len(bucket)} tensors, version {version}"),
                               "/update_weights_from_distributed")
            except Exception as err:  # surfaced after the broadcasts
                errors.append(err)

        poster = threading.Thread(target=post)
        poster.start()
        for _, tensor in bucket:  # the server receives in `names` order
            self.broadcast_group.broadcast(tensor.contiguous())
        poster.join()
        if errors:
            raise errors[0]

    def weight_version(self) -> int:
        """The server's own report when it has one, else the last version pushed."""
        info = self.model_info()
        reported = info.get("weight_version") if isinstance(info, dict) else None
        version = int(reported) if reported not in (None, "", "default") else self._version
        if self._lora_config is None and version > 0:  # not the pusher: serve the adapter a push loaded, if any
            self._lora_name = self._served_adapter()
        return version


def _check_success(answer, endpoint: str) -> None:
    if isinstance(answer, dict) and answer.get("success") is False:
        raise RuntimeError(f"{endpoint} failed: {answer.get('message')}")
