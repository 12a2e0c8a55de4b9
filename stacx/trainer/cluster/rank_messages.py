"""Values the ranks of a torchrun job send each other, encoded without pickle.

On the torchrun path rank 0 shares the step's batch (and a few small values) with every rank and
every rank's results are gathered (`cluster.local.TorchrunChannel` / `LocalRoleGroup`). torch's
`broadcast_object_list` / `all_gather_object` would unpickle whatever arrives, so a process that
reached the job's gloo/NCCL connections could make a rank run code. Here a value travels as one
uint8 tensor, and decoding builds only plain values:

    message = header_length (8 bytes, little endian) || header (UTF-8 JSON) || tensor data
    header  = {"version": 1, "value": node, "tensors": [{"dtype", "shape", "offset", "num_bytes"}, ...]}
    node    = null | bool | int | float | str | [node, ...]              (a list)
            | {"tuple": [node, ...]} | {"dict": [[key node, node], ...]} | {"path": str}
            | {"tensor": index}                       (raw bytes at `offset` of the data section)
            | {"record": name, "fields": {field: node}}   (a dataclass from `MESSAGE_RECORDS`)

The data section is one bucket of the tensor codec (`stacx.parallel.tensor_buckets`: 64-byte
aligned offsets, dtypes from its closed table `TENSOR_DTYPES`, every slot checked the same way);
records come from the closed table `MESSAGE_RECORDS`. Decoded tensors are CPU
tensors. Anything else is refused when encoding (`TypeError` naming where in the value it is) and
when decoding (`RankMessageError` naming the field).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os
import pathlib
from typing import Any

import torch
import torch.distributed as dist

from stacx.parallel.tensor_buckets import TENSOR_DTYPES, check_slot, pack_bucket, plan_buckets
from stacx.trainer.batch import StepBatch
from stacx.trainer.checkpoint import FileInfo, RankCoords, RankFileInfo

MESSAGE_VERSION = 1
LENGTH_BYTES = 8
MESSAGE_RECORDS: dict[str, type] = {cls.__name__: cls for cls in (RankCoords, FileInfo, RankFileInfo, StepBatch)}
"""The dataclasses a message may hold (what `RoleRuntime.save_rank_state` returns, the step batch)."""
_NODE_TAGS = ("tuple", "dict", "path", "tensor", "record")


class RankMessageError(ValueError):
    """A received message that is not a well-formed encoding (names the field)."""


# ---- encoding ------------------------------------------------------------------------------------

class _Encoder:
    def __init__(self):
        self.tensors: list[torch.Tensor] = []

    def node(self, value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, numbers.Real):
            return float(value)
        if isinstance(value, torch.Tensor):
            if value.dtype not in TENSOR_DTYPES.values():
                raise TypeError(f"rank message: {where} is a {value.dtype} tensor; dtypes: {sorted(TENSOR_DTYPES)}")
            self.tensors.append(value.detach().to("cpu").contiguous())
            return {"tensor": len(self.tensors) - 1}
        if isinstance(value, list):
            return [self.node(item, f"{where}[{i}]") for i, item in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return {"tuple": [self.node(item, f"{where}[{i}]") for i, item in enumerate(value)]}
        if isinstance(value, dict):
            return {"dict": [[self.node(k, f"{where} key {k!r}"), self.node(v, f"{where}[{k!r}]")]
                             for k, v in value.items()]}
        if isinstance(value, pathlib.PurePath):
            return {"path": os.fspath(value)}
        name = type(value).__name__
        if dataclasses.is_dataclass(value) and MESSAGE_RECORDS.get(name) is type(value):
            return {"record": name, "fields": {f.name: self.node(getattr(value, f.name), f"{where}.{f.name}")
                                               for f in dataclasses.fields(value)}}
        raise TypeError(f"rank message: {where} is a {type(value).__module__}.{name}, which torchrun ranks do not "
                        "exchange (no pickle); send plain values, tensors, or add the dataclass to MESSAGE_RECORDS")


def encode_message(value: Any) -> torch.Tensor:
    """`value` as one uint8 CPU tensor [num_bytes] (see the module docstring for the layout)."""
    encoder = _Encoder()
    tree = encoder.node(value, "value")
    named = [(str(index), tensor) for index, tensor in enumerate(encoder.tensors)]
    slots, sizes = plan_buckets(named)  # the one tensor codec's layout, in one bucket
    offset = sizes[0] if sizes else 0
    entries = [{"dtype": s.dtype, "shape": list(s.shape), "offset": s.offset, "num_bytes": s.num_bytes} for s in slots]
    header = json.dumps({"version": MESSAGE_VERSION, "value": tree, "tensors": entries},
                        separators=(",", ":")).encode()
    message = torch.zeros(LENGTH_BYTES + len(header) + offset, dtype=torch.uint8)
    message[:LENGTH_BYTES] = torch.frombuffer(bytearray(len(header).to_bytes(LENGTH_BYTES, "little")), dtype=torch.uint8)
    message[LENGTH_BYTES:LENGTH_BYTES + len(header)] = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    if offset:
        pack_bucket(named, slots, 0, offset, out=message[LENGTH_BYTES + len(header):])
    return message


# ---- sending between the ranks of the default group -----------------------------------------------

def _message_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def broadcast_value(value: Any, *, src: int = 0) -> Any:
    """Rank `src`'s `value` on every rank (two broadcasts: the length, then the message)."""
    device = _message_device()
    is_source = dist.get_rank() == src
    message = encode_message(value).to(device) if is_source else None
    length = torch.tensor([message.numel() if is_source else 0], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src)
    if not is_source:
        message = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.broadcast(message, src=src)
    return value if is_source else decode_message(message)


def all_gather_values(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank (messages padded to the longest)."""
    device = _message_device()
    world_size = dist.get_world_size()
    message = encode_message(value).to(device)
    lengths = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(lengths, torch.tensor([message.numel()], dtype=torch.int64, device=device))
    sizes = [int(length.item()) for length in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[:message.numel()] = message
    gathered = [torch.empty(max(sizes), dtype=torch.uint8, device=device) for _ in range(world_size)]
    dist.all_gather(gathered, padded)
    return [decode_message(buffer[:size]) for buffer, size in zip(gathered, sizes)]


# ---- decoding ------------------------------------------------------------------------------------

def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _decode_tensors(entries: Any, data: torch.Tensor) -> list[torch.Tensor]:
    if not isinstance(entries, list):
        raise RankMessageError(f"rank message: 'tensors' must be a list, got {type(entries).__name__}")
    tensors = []
    for index, entry in enumerate(entries):
        where = f"rank message: tensors[{index}]"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "offset", "num_bytes"}:
            raise RankMessageError(f"{where} must have exactly dtype, shape, offset, num_bytes")
        slot = check_slot({"name": f"tensors[{index}]", "bucket": 0, **entry}, where, bucket_bytes=data.numel(),
                          error=RankMessageError)
        raw = data[slot.offset:slot.offset + slot.num_bytes].clone()  # owns its memory, aligned for any dtype
        tensors.append(raw.view(TENSOR_DTYPES[slot.dtype]).reshape(slot.shape))
    return tensors


def _decode_node(node: Any, tensors: list[torch.Tensor], where: str) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_decode_node(item, tensors, f"{where}[{i}]") for i, item in enumerate(node)]
    if not isinstance(node, dict) or not (node.keys() & set(_NODE_TAGS)):
        raise RankMessageError(f"rank message: {where} is {str(node)[:80]!r}; expected a plain value or an "
                               f"object tagged with one of {list(_NODE_TAGS)}")
    if "tuple" in node and set(node) == {"tuple"} and isinstance(node["tuple"], list):
        return tuple(_decode_node(item, tensors, f"{where}[{i}]") for i, item in enumerate(node["tuple"]))
    if "dict" in node and set(node) == {"dict"} and isinstance(node["dict"], list):
        out = {}
        for i, pair in enumerate(node["dict"]):
            if not isinstance(pair, list) or len(pair) != 2:
                raise RankMessageError(f"rank message: {where}.dict[{i}] must be a [key, value] pair")
            key = _decode_node(pair[0], tensors, f"{where} key {i}")
            if not isinstance(key, (str, int, float, bool, tuple, type(None))):
                raise RankMessageError(f"rank message: {where} key {i} is a {type(key).__name__}, not a plain key")
            out[key] = _decode_node(pair[1], tensors, f"{where}[{key!r}]")
        return out
    if "path" in node and set(node) == {"path"} and isinstance(node["path"], str):
        return pathlib.Path(node["path"])
    if "tensor" in node and set(node) == {"tensor"}:
        index = node["tensor"]
        if not _is_count(index) or index >= len(tensors):
            raise RankMessageError(f"rank message: {where} names tensor {index!r}; the message has {len(tensors)}")
        return tensors[index]
    if "record" in node and set(node) == {"record", "fields"}:
        cls = MESSAGE_RECORDS.get(node["record"]) if isinstance(node["record"], str) else None
        fields = node["fields"]
        if cls is None:
            raise RankMessageError(f"rank message: {where}.record {node['record']!r} is not one of "
                                   f"{sorted(MESSAGE_RECORDS)}")
        expected = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(fields, dict) or set(fields) != expected:
            raise RankMessageError(f"rank message: {where}.fields of {node['record']} must be {sorted(expected)}")
        return cls(**{name: _decode_node(v, tensors, f"{where}.{name}") for name, v in fields.items()})
    raise RankMessageError(f"rank message: {where} has keys {sorted(node)}; each tag stands alone "
                           f"(one of {list(_NODE_TAGS)}, or 'record' with 'fields')")


def decode_message(message: torch.Tensor) -> Any:
    """The value `encode_message` encoded into `message` (uint8 [num_bytes], any device)."""
    if message.dtype != torch.uint8 or message.dim() != 1:
        raise RankMessageError(f"rank message must be a 1-d uint8 tensor, got {message.dtype} of shape "
                               f"{tuple(message.shape)}")
    message = message.cpu()
    if message.numel() < LENGTH_BYTES:
        raise RankMessageError(f"rank message of {message.numel()} bytes is shorter than its length field")
    header_length = int.from_bytes(bytes(message[:LENGTH_BYTES].tolist()), "little")
    if header_length > message.numel() - LENGTH_BYTES:
        raise RankMessageError(f"rank message: header length {header_length} exceeds the "
                               f"{message.numel() - LENGTH_BYTES} bytes that follow")
    try:
        header = json.loads(message[LENGTH_BYTES:LENGTH_BYTES + header_length].numpy().tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise RankMessageError(f"rank message: the header is not UTF-8 JSON ({err})") from err
    if not isinstance(header, dict) or set(header) != {"version", "value", "tensors"}:
        raise RankMessageError("rank message: the header must have exactly version, value, tensors")
    if header["version"] != MESSAGE_VERSION:
        raise RankMessageError(f"rank message: version {header['version']!r}, this Stacx reads {MESSAGE_VERSION} "
                               "(every rank must run the same Stacx)")
    tensors = _decode_tensors(header["tensors"], message[LENGTH_BYTES + header_length:])
    try:
        return _decode_node(header["value"], tensors, "value")
    except RecursionError as err:
        raise RankMessageError("rank message: the value is nested too deeply") from err
