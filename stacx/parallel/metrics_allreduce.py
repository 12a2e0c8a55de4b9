"""Loss metrics of a micro-batch: every sum and count in ONE all-reduce over a flat buffer.

Specializations return metrics as SUMS over their local tokens (loss-mask weighted), plus any
counts they need. The worker reduces them here, once per packed micro-batch, over the DP x CP
group (each CP rank holds different tokens), accumulates over micro-batches, and divides by the
step's reduced count metrics at the end (the specialization knows which count divides which sum):

    totals = MetricTotals()
    for micro_batch in ...:
        loss, metric_sums = specialization.compute_loss(...)
        totals.add(all_reduce_metric_sums(metric_sums, groups.dp_cp))
    means = specialization.metric_means(totals.sums)   # sum / its count metric (num_loss_tokens, ...)

A checksum of the metric names travels in the same buffer, so ranks that disagree on which
metrics they report fail loudly instead of summing unrelated numbers.
"""

from __future__ import annotations

import zlib
from typing import Mapping

import torch
import torch.distributed as dist

from stacx.parallel.collectives import all_reduce_sum_, group_size


def metric_names_checksum(names) -> int:
    return zlib.crc32("\x00".join(names).encode()) & 0x7FFFFFFF


def all_reduce_metric_sums(metric_sums: Mapping[str, torch.Tensor | float], group: dist.ProcessGroup | None) -> dict[str, float]:
    """Sum every metric over `group` in one all-reduce of a float64 buffer; returns plain floats."""
    names = sorted(metric_sums)
    device = next((v.device for v in metric_sums.values() if torch.is_tensor(v)), torch.device("cpu"))
    checksum = metric_names_checksum(names)
    # Stacked on the metrics' own device: no host sync per metric, one for the whole buffer.
    buffer = torch.stack(
        [torch.as_tensor(metric_sums[name], dtype=torch.float64, device=device).detach().reshape(()) for name in names]
        + [torch.tensor(float(checksum), dtype=torch.float64, device=device)]
    )
    all_reduce_sum_(buffer, group)
    buffer = buffer.cpu()
    if int(buffer[-1]) != checksum * group_size(group):
        raise RuntimeError(f"ranks reported different metric names in this micro-batch; this rank has {names}")
    return dict(zip(names, buffer[:-1].tolist()))


class MetricTotals:
    """Accumulates reduced metric sums over a step's micro-batches."""

    def __init__(self):
        self.sums: dict[str, float] = {}

    def add(self, reduced: Mapping[str, float]) -> None:
        for name, value in reduced.items():
            self.sums[name] = self.sums.get(name, 0.0) + value
