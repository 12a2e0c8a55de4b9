"""Stacx's weight loading inside a vLLM worker: vLLM's `worker_extension_cls`.

vLLM mixes this class into each of its workers (`--worker-extension-cls
stacx_vllm_worker.StacxWorkerExtension`, with this folder and the Stacx checkout on the server's
PYTHONPATH) and the client calls its methods through vLLM's `POST /collective_rpc` (served with
VLLM_SERVER_DEV_MODE=1). Every argument is one JSON string, every answer a JSON object:

    stacx_load_bucket(header)      one bucket of Hugging Face-named tensors, staged by the client
    stacx_weight_digests(request)  {name: digest} of what the engine holds now (post-sync check)
    stacx_weight_version()         the version of the weights the engine serves
    stacx_reset_weight_version()   serve them as version 0 (a new run attaching to a long-lived server)
    stacx_weight_transfer()        the backend of vLLM's weight-transfer API the server was started with
    stacx_transfer_finished(req)   an update through that API (`--vllm-weight-transfer`) is done: serve its version

A bucket is Stacx's own format (`stacx.parallel.tensor_buckets`: names, dtypes, shapes, offsets
into one flat buffer), staged either in a same-host shared-memory file the client wrote
(`staging_path`, a `stacx-weights-*` file of the shared-memory folder) or carried in the request
(`body_b64`, base64 of the raw bytes: another host). A bucket is refused, before any parameter is
touched, when its header is malformed, a tensor holds NaN or infinity (a diverged trainer), or its
version and number replay an update (versions only move forward, buckets come once and in order:
the rules of `stacx serve`, stacx.wire.weight_versions). Loading goes through vLLM's
layerwise reload (the first bucket of a version starts it, the final one finishes it), which
re-runs each layer's post-load processing, so a CPU engine's repacked GEMM weights are rebuilt.

Weights sent through vLLM's own weight-transfer API (NCCL, or gloo on CPU: `stacx_gloo_transfer`, registered
here when vLLM imports this module) are loaded by vLLM; the sender then reports the version with
`stacx_transfer_finished`, under the same version rules.

This module imports torch, the standard library and `stacx.parallel` only (vLLM's environment
does not hold Stacx's dependencies), and vLLM inside the methods.
"""

from __future__ import annotations

import base64
import json
import os
import stat
from typing import Any, Optional

import torch

from stacx.parallel.tensor_buckets import check_bucket_header, unpack_bucket
from stacx.parallel.tensor_digests import tensor_digest

STAGING_PREFIX = "stacx-weights-"
"""Name prefix of the staging files a client may name (`stacx.wire.weight_transfer.SHM_FILE_PREFIX`)."""


class BucketRefused(ValueError):
    """A bucket the worker did not load (the message says why); collective_rpc reports it as an error."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_bucket_header(header: Any, num_bytes_available: int) -> list:
    """The header's tensor slots, every field checked before any byte is viewed (`BucketRefused` names it):
    `stacx serve`'s header rules (`tensor_buckets.check_bucket_header`), with versions from 1 and the bucket
    number required."""
    return check_bucket_header(header, num_bytes_available, where="stacx_load_bucket", first_version=1,
                               bucket_required=True, error=BucketRefused)


def open_staging_file(path: Any, num_bytes: int) -> torch.Tensor:
    """The first `num_bytes` of a client's staging file, mapped: only a regular `stacx-weights-*` file
    directly in the shared-memory folder, owned by this server's user, is opened (never a link)."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
    if not isinstance(path, str) or not os.path.basename(path).startswith(STAGING_PREFIX):
        raise BucketRefused(f"stacx_load_bucket: 'staging_path' {str(path)[:120]!r} is not a {STAGING_PREFIX}* file")
    if folder is not None and os.path.dirname(os.path.abspath(path)) != folder:
        raise BucketRefused(f"stacx_load_bucket: 'staging_path' {path!r} is not in {folder}")
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise BucketRefused(f"stacx_load_bucket: staging file {path} does not exist (is the engine on another "
                            "host? send weights with weight_transport='http')") from None
    if not stat.S_ISREG(info.st_mode):
        raise BucketRefused(f"stacx_load_bucket: staging file {path} is not a regular file")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():  # another local user's file is not our trainer's
        raise BucketRefused(f"stacx_load_bucket: staging file {path} belongs to uid {info.st_uid}, not this server's "
                            f"user ({os.getuid()})")
    if info.st_size < num_bytes:
        raise BucketRefused(f"stacx_load_bucket: staging file {path} holds {info.st_size} bytes, the header "
                            f"says {num_bytes}")
    if num_bytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=False, size=num_bytes, dtype=torch.uint8)


def refuse_non_finite(named_tensors) -> None:
    for name, tensor in named_tensors:
        if tensor.dtype.is_floating_point and not bool(torch.isfinite(tensor).all()):
            raise BucketRefused(f"stacx_load_bucket: tensor {name!r} holds "
                                f"{int((~torch.isfinite(tensor)).sum())} NaN or infinite values; the bucket was not "
                                "loaded (the sender's weights diverged)")


class VersionOrder:
    """Versions only move forward; within a version, buckets come once and in order."""

    def __init__(self):
        self.served = 0
        self.loading: Optional[tuple[int, int]] = None
        """(version, last bucket) of the update being loaded."""

    def admit(self, version: int, bucket: int) -> bool:
        """Whether this bucket starts a new update (True) or continues the one being loaded (False);
        raises BucketRefused for a replayed or stale bucket."""
        if version <= self.served:
            raise BucketRefused(f"stacx_load_bucket: weight version {version} is not newer than the version this "
                                f"engine serves ({self.served}); versions only move forward (a replayed or stale "
                                "update)")
        if self.loading is not None and self.loading[0] == version:
            if bucket <= self.loading[1]:
                raise BucketRefused(f"stacx_load_bucket: bucket {bucket} of weight version {version} comes after "
                                    f"bucket {self.loading[1]} was accepted; a bucket is sent once, in order (a "
                                    "replayed or stale bucket)")
            return False
        if self.loading is not None and version < self.loading[0]:
            raise BucketRefused(f"stacx_load_bucket: weight version {version} is older than the update being loaded "
                                f"({self.loading[0]})")
        if bucket != 0:
            raise BucketRefused(f"stacx_load_bucket: weight version {version} starts with bucket {bucket}, not 0")
        return True


def stacked_source(model: torch.nn.Module, hf_name: str):
    """(vLLM parameter name, shard index) holding Hugging Face tensor `hf_name` in a fused parameter
    (qkv_proj, gate_up_proj: the model's `packed_modules_mapping`), or None when it is not fused."""
    mapping = getattr(model, "packed_modules_mapping", None) or {}
    parts = hf_name.split(".")
    for fused, shards in mapping.items():
        for index, shard in enumerate(shards):
            if shard in parts:
                position = parts.index(shard)
                return ".".join(parts[:position] + [fused] + parts[position + 1:]), index
    return None


FUSED_EXPERT_FOLDERS = ("", "routed_experts.")
"""Where a layer's fused expert weights sit under its `experts` module: directly (`experts.w13_weight`), or in vLLM
0.32's `RoutedExperts` submodule (`experts.routed_experts.w13_weight`, Qwen3-MoE on CPU)."""


def expert_source(hf_name: str):
    """(vLLM fused-experts parameter, expert, rows) for `...mlp.experts.E.{gate,up,down}_proj.weight`, else None;
    the parameter named as directly under `experts` (`read_back` looks in FUSED_EXPERT_FOLDERS).
    rows: 'first' / 'second' half of w13 (gate, up), or 'all' of w2 (down)."""
    parts = hf_name.split(".")
    if "experts" not in parts or parts[-1] != "weight":
        return None
    i = parts.index("experts")
    if i + 3 != len(parts) - 1 or not parts[i + 1].isdigit():
        return None
    prefix, expert, proj = ".".join(parts[:i + 1]), int(parts[i + 1]), parts[i + 2]
    if proj in ("gate_proj", "w1"):
        return f"{prefix}.w13_weight", expert, "first"
    if proj in ("up_proj", "w3"):
        return f"{prefix}.w13_weight", expert, "second"
    if proj in ("down_proj", "w2"):
        return f"{prefix}.w2_weight", expert, "all"
    return None


def linear_weight(module: torch.nn.Module, param: torch.Tensor) -> Optional[torch.Tensor]:
    """A linear layer's full [out, in] weight: the parameter itself, or, where vLLM's CPU GEMM kept only a
    repacked copy (the parameter is emptied), the layer applied to the identity (exact: one product per
    entry)."""
    if param.numel():
        return param
    cpu_linear = getattr(module, "cpu_linear", None)
    # a tensor-parallel linear's input width; a replicated one (an MoE router) has only `input_size`
    in_features = getattr(module, "input_size_per_partition", None) or getattr(module, "input_size", None)
    if cpu_linear is None or not isinstance(in_features, int):
        return None
    identity = torch.eye(in_features, dtype=param.dtype)
    return cpu_linear(identity, None, None).t()


def cpu_prepack_isa(module: torch.nn.Module) -> Optional[str]:
    """The grouped-GEMM layout ('vec', 'amx', ...) vLLM's CPU MoE kernel keeps `module`'s fused expert weights in
    (`CPUUnquantizedExperts.process_weights_after_loading` prepacks them), else None."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return None
    experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
    if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
        return None
    return experts.isa


_PREPACK_ORDERS: dict = {}


def unpack_cpu_experts(param: torch.Tensor, isa: str) -> torch.Tensor:
    """`param` [experts, rows, cols] from vLLM's prepacked CPU layout back to the plain one. The layout is a
    permutation within each expert, found by prepacking the positions themselves (in digits small enough to stay
    exact in the parameter's dtype)."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    key = (tuple(param.shape[1:]), param.dtype, isa)
    if key not in _PREPACK_ORDERS:
        count = param[0].numel()
        base = 128 if param.dtype in (torch.bfloat16, torch.float16) else 4096
        positions, order, scale = torch.arange(count), torch.zeros(count, dtype=torch.long), 1
        while scale < count:
            digit = (positions // scale % base).to(param.dtype).reshape(1, *param.shape[1:])
            order += cpu_prepack_moe_weight(digit, isa).flatten().long() * scale
            scale *= base
        _PREPACK_ORDERS[key] = order
    order = _PREPACK_ORDERS[key]
    plain = torch.empty_like(param).reshape(param.shape[0], -1)
    plain[:, order] = param.reshape(param.shape[0], -1)
    return plain.reshape(param.shape)


def keep_cpu_experts_prepacked(model: torch.nn.Module) -> None:
    """Works around vLLM 0.32 serving corrupted experts after a weight update on CPU: on an update its
    `UnquantizedFusedMoEMethod._setup_kernel` (fused_moe/unquantized_fused_moe_method.py) copies the new weights in
    but skips the kernel's own `process_weights_after_loading`, which on CPU is what prepacks them into the
    grouped-GEMM layout, so the kernel reads plain weights as prepacked. Each MoE layer's processing here runs it
    after an update too (only where vLLM pads nothing: its CPU padding assumes unpadded weights)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or getattr(method, "_stacx_prepacks_on_update", False) or cpu_prepack_isa(module) is None:
            continue
        experts = method.moe_kernel.fused_experts
        if experts._padded_intermediate_size(experts.moe_config) != experts.moe_config.intermediate_size_per_partition:
            continue
        original = method.process_weights_after_loading

        def process(layer, _original=original, _method=method):
            updating = getattr(_method, "moe_kernel", None) is not None
            _original(layer)
            if updating and cpu_prepack_isa(layer) is not None:
                _method.moe_kernel.fused_experts.process_weights_after_loading(layer)

        method.process_weights_after_loading = process
        method._stacx_prepacks_on_update = True


def served_name(params: dict, name: str) -> str:
    """`name`, or where a server with LoRA loading on (`--enable-lora`) wrapped its layer, the wrapped layer's own
    parameter (`...qkv_proj.base_layer.weight`: vLLM's LoRA layers keep the layer they wrap as `base_layer`)."""
    if name in params:
        return name
    module, _, leaf = name.rpartition(".")
    wrapped = f"{module}.base_layer.{leaf}"
    return wrapped if wrapped in params else name


def read_back(model: torch.nn.Module, params: dict, hf_name: str) -> Optional[torch.Tensor]:
    """The tensor the engine holds under Hugging Face name `hf_name` (None: not readable here)."""
    expert = expert_source(hf_name)
    if expert is not None:
        name, index, rows = expert
        folder, _, weight_name = name.rpartition(".")
        found = [f"{folder}.{sub}{weight_name}" for sub in FUSED_EXPERT_FOLDERS if f"{folder}.{sub}{weight_name}" in params]
        if found:
            isa = cpu_prepack_isa(model.get_submodule(found[0].rpartition(".")[0]))
            weight = (params[found[0]] if isa is None else unpack_cpu_experts(params[found[0]], isa))[index]
            half = weight.shape[0] // 2
            return {"first": weight[:half], "second": weight[half:], "all": weight}[rows]
    stacked = stacked_source(model, hf_name)
    if stacked is not None and served_name(params, stacked[0]) in params:
        name, shard = served_name(params, stacked[0]), stacked[1]
        module = model.get_submodule(name.rpartition(".")[0])
        full = linear_weight(module, params[name]) if name.endswith("weight") else params[name]
        sizes = getattr(module, "output_sizes", None)
        if full is None or not sizes or sum(sizes) != full.shape[0]:
            return None
        start = sum(sizes[:shard])
        return full[start:start + sizes[shard]]
    name = served_name(params, hf_name)
    if name in params:
        param = params[name]
        module = model.get_submodule(name.rpartition(".")[0])
        if name.endswith("weight") and not param.numel():
            return linear_weight(module, param)
        vocab = getattr(module, "org_vocab_size", None)  # embeddings and LM head: rows padded past the vocab
        return param[:vocab] if isinstance(vocab, int) and param.shape[0] > vocab else param
    if hf_name == "lm_head.weight" and "model.embed_tokens.weight" in params:  # tied embeddings
        return read_back(model, params, "model.embed_tokens.weight")
    return None


class StacxWorkerExtension:
    """Methods vLLM adds to its worker (`self` is the worker: `self.model_runner`, `self.vllm_config`)."""

    def _stacx_order(self) -> VersionOrder:
        if not hasattr(self, "_stacx_version_order"):
            self._stacx_version_order = VersionOrder()
        return self._stacx_version_order

    def stacx_weight_version(self) -> dict:
        return {"weight_version": self._stacx_order().served}

    def stacx_reset_weight_version(self) -> dict:
        """Serve the current weights as version 0: a new run attaching to a long-lived server numbers its
        pushes from 1 again (an unfinished update is finished first)."""
        order = self._stacx_order()
        if order.loading is not None:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
        order.served, order.loading = 0, None
        return {"weight_version": 0}

    def stacx_load_bucket(self, header_json: str) -> dict:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        header = json.loads(header_json)
        if not isinstance(header, dict):
            raise BucketRefused("stacx_load_bucket: the header must be a JSON object")
        if "body_b64" in header:
            raw = bytearray(base64.b64decode(header["body_b64"]))
            data = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            slots = parse_bucket_header(header, data.numel())
        else:
            slots = parse_bucket_header(header, 1 << 62)
            data = open_staging_file(header.get("staging_path"), header["num_bytes"])
        order = self._stacx_order()
        starts = order.admit(header["version"], header["bucket"])
        tensors = list(unpack_bucket(data[:header["num_bytes"]], slots).items())
        refuse_non_finite(tensors)
        model = self.model_runner.get_model()
        # layerwise reload keeps a layer's tensors until the layer is complete: own copies, not views of the file
        tensors = [(name, tensor.clone()) for name, tensor in tensors]
        with set_current_vllm_config(self.vllm_config):
            if starts:
                keep_cpu_experts_prepacked(model)
                if order.loading is not None:  # an abandoned update: finish it before starting anew
                    finalize_layerwise_reload(model, self.vllm_config.model_config)
                initialize_layerwise_reload(model)
            order.loading = (header["version"], header["bucket"])
            with disable_mtp_completeness_check():
                model.load_weights(tensors)
            if header["final"]:
                finalize_layerwise_reload(model, self.vllm_config.model_config)
                order.served, order.loading = header["version"], None
        return {"loaded": len(tensors), "version": header["version"], "bucket": header["bucket"],
                "final": header["final"]}

    def _stacx_serve_loaded(self, method: str, request_json: str) -> dict:
        """Weights loaded another way than `stacx_load_bucket` are served as the request's `version` (versions
        only move forward, as for weight buckets)."""
        request = json.loads(request_json)
        version = request.get("version") if isinstance(request, dict) else None
        if not _is_int(version):
            raise BucketRefused(f"{method}: 'version' must be an integer, got {version!r}")
        order = self._stacx_order()
        if order.loading is not None:
            raise BucketRefused(f"{method}: weight version {order.loading[0]} is still being loaded")
        order.admit(version, 0)
        order.served = version
        return {"weight_version": version}

    def stacx_adapters_loaded(self, request_json: str) -> dict:
        """The client loaded a LoRA adapter through `/v1/load_lora_adapter` (an adapter-only push): serve its
        `version`."""
        return self._stacx_serve_loaded("stacx_adapters_loaded", request_json)

    def stacx_transfer_finished(self, request_json: str) -> dict:
        """The client's update through vLLM's weight-transfer API finished (`/finish_weight_update`): serve its
        `version`."""
        return self._stacx_serve_loaded("stacx_transfer_finished", request_json)

    def stacx_weight_transfer(self) -> dict:
        """{"backend": vLLM's weight-transfer backend this server was started with (--weight-transfer-config),
        or None}."""
        config = getattr(self.vllm_config, "weight_transfer_config", None)
        keep_cpu_experts_prepacked(self.model_runner.get_model())  # asked before the first transfer
        return {"backend": getattr(config, "backend", None)}

    def stacx_weight_digests(self, request_json: str) -> dict:
        """{"digests": {name: digest or None (not readable)}, "dtype": the engine's parameter dtype} for
        the request's `names` (Hugging Face names), each cast to the engine's dtype."""
        request = json.loads(request_json)
        names = request.get("names") if isinstance(request, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("stacx_weight_digests: 'names' must be a list of tensor names")
        dtype = self.vllm_config.model_config.dtype
        model = self.model_runner.get_model()
        params = dict(model.named_parameters())
        digests = {}
        with torch.no_grad():
            for name in names:
                tensor = read_back(model, params, name)
                digests[name] = None if tensor is None else tensor_digest(tensor, dtype=dtype)
        return {"digests": digests, "dtype": str(dtype).removeprefix("torch.")}

    def stacx_model_dtype(self) -> dict:
        return {"dtype": str(self.vllm_config.model_config.dtype).removeprefix("torch.")}


try:  # inside vLLM's worker: offer the gloo backend of its weight-transfer API before the worker builds its engine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as _Factory  # noqa: F401
except ImportError:  # imported outside vLLM's environment (Stacx's tests of this module)
    pass
else:
    if __package__:  # imported as part of the stacx package
        from .stacx_gloo_transfer import register as _register_gloo_transfer
    else:  # vLLM imports it from this folder on its PYTHONPATH
        from stacx_gloo_transfer import register as _register_gloo_transfer

    _register_gloo_transfer()
