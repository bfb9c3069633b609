"""Flower records <-> ftis tensors and metrics, for both sides of a federated run's messages.

Messages (content keys):
    query "identify"   server -> client {config: {query}}; reply {config: {client: name}}
    train              server -> client {arrays: theta, config: {round, <the algorithm's keys>}};
                       reply {arrays: delta, metrics: {num-examples, <the algorithm's keys, e.g.
                              FGRPO's performance>, <row metrics>}, config: {client: name}}
    evaluate           server -> client {arrays: theta, config: {round}};
                       reply {metrics: {eval/...}, config: {client: name}}
Arrays travel as float32 .npy (Flower's ArrayRecord; no pickle). Importing this module imports
flwr after `ftis.algos.federated` (its package) has switched telemetry off.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

from ftis.algos.federated.params import (  # noqa: F401  (the message keys, re-exported)
    ARRAYS,
    CLIENT_KEY,
    CONFIG,
    COUNT_KEY,
    METRICS,
    PERF_KEY,
    ROUND_KEY,
)
from ftis.exchange.deltas import check_delta
from ftis.exchange.wire import PayloadError


def to_numpy(tensors: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """float32 numpy copies (bfloat16 has no numpy dtype; float32 holds it exactly)."""
    return {k: v.detach().to("cpu", torch.float32).numpy() for k, v in tensors.items()}


def array_record(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    rec = ArrayRecord()
    for k, v in arrays.items():
        rec[k] = Array(np.ascontiguousarray(v))
    return rec


def read_arrays(rec: Any) -> dict[str, np.ndarray]:
    """The arrays of an ArrayRecord; PayloadError for anything unreadable."""
    if not isinstance(rec, ArrayRecord):
        raise PayloadError(f"expected an ArrayRecord, got {type(rec).__name__}")
    out = {}
    for k, a in rec.items():
        try:
            out[k] = a.numpy()
        except Exception as e:  # TypeError (stype), ValueError/EOFError (bytes): all unusable
            raise PayloadError(f"array {k!r} cannot be read: {e}") from None
    return out


def read_params(rec: Any, reference: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checked tensors (names, shapes, finite) from an ArrayRecord; PayloadError otherwise."""
    return check_delta(read_arrays(rec), reference)


def scalar_metrics(metrics: Mapping[str, Any]) -> dict[str, float | int]:
    """The plain int/float entries of a metrics dict, as Flower's MetricRecord accepts them."""
    out: dict[str, float | int] = {}
    for k, v in metrics.items():
        if isinstance(v, bool):
            v = int(v)
        if isinstance(v, int | float | np.integer | np.floating):
            out[str(k)] = v.item() if isinstance(v, np.generic) else v
    return out


def metric_record(metrics: Mapping[str, Any]) -> MetricRecord:
    return MetricRecord(scalar_metrics(metrics))


def config_record(values: Mapping[str, Any]) -> ConfigRecord:
    return ConfigRecord(dict(values))
