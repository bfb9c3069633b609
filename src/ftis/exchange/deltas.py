"""Parameter deltas as payloads: validation, and a bytes codec for byte transports.

A delta is a dict name -> tensor: every trainable weight of a model, or its LoRA adapters only.
A receiver (a federated server) checks a client's delta against the tensors it expects
(`check_delta`): the same names, the same shapes, a floating dtype, every value finite.
Anything else raises `PayloadError` (a ValueError) naming the first problem, never another error,
so one bad client is rejected for its round and never aggregated.

Over Flower, arrays travel in Flower's own `ArrayRecord` (numpy's .npy, no pickle) and the
server runs `check_delta` on what it decoded. Over ftis's byte transports, `DeltaCodec` turns a
delta into safetensors bytes and back (no pickle either), with the same checks on decode.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ftis.exchange.wire import PayloadError


def _as_tensor(name: str, value: Any) -> Tensor:
    """A tensor view of `value` (a tensor or a numpy array), or PayloadError."""
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, np.ndarray):
        if value.dtype.kind != "f":
            raise PayloadError(f"tensor {name!r} has dtype {value.dtype}, expected floating point")
        try:
            return torch.from_numpy(np.ascontiguousarray(value))
        except (TypeError, ValueError, RuntimeError) as e:
            raise PayloadError(f"tensor {name!r} cannot be read: {e}") from None
    raise PayloadError(f"tensor {name!r} is a {type(value).__name__}, not an array")


def check_delta(delta: Any, reference: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """`delta` checked against `reference` and converted to its dtypes, on the CPU.

    delta: a mapping name -> tensor or numpy array. reference: the tensors the receiver
    expects (e.g. the global trainable parameters); only their names, shapes and dtypes are used.
    Raises PayloadError when a name is missing or unexpected, a shape differs, a dtype is not
    floating point, or a value is NaN/inf.
    """
    if not isinstance(delta, Mapping):
        raise PayloadError(f"a delta must map tensor names to arrays, got {type(delta).__name__}")
    names = set(delta)
    expected = set(reference)
    if names != expected:
        missing, extra = sorted(expected - names), sorted(str(n) for n in names - expected)
        parts = []
        if missing:
            parts.append(f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}")
        if extra:
            parts.append(f"unexpected {extra[:3]}{' ...' if len(extra) > 3 else ''}")
        raise PayloadError(f"delta tensor names do not match the model's: {'; '.join(parts)}")
    out: dict[str, Tensor] = {}
    for name, ref in reference.items():
        t = _as_tensor(name, delta[name])
        if not torch.is_floating_point(t):
            raise PayloadError(f"tensor {name!r} has dtype {t.dtype}, expected floating point")
        if tuple(t.shape) != tuple(ref.shape):
            raise PayloadError(
                f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(ref.shape)}"
            )
        if not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise PayloadError(f"tensor {name!r} has {bad} non-finite values")
        out[name] = t.to(device="cpu", dtype=ref.dtype)
    return out


class DeltaCodec:
    """Deltas <-> safetensors bytes, for transports that move bytes (`ftis.exchange.Transport`).

    reference: the tensors a decoded delta must match (names, shapes; converted to their
    dtypes). max_bytes: the largest payload accepted (default: 4 bytes per reference value plus
    headers, times 2).
    """

    def __init__(self, reference: Mapping[str, Tensor], *, max_bytes: int | None = None) -> None:
        self.reference = {k: v.detach() for k, v in reference.items()}
        numel = sum(v.numel() for v in self.reference.values())
        self.max_bytes = max_bytes or 2 * (4 * numel + 256 * len(self.reference)) + 4096

    def encode(self, delta: Mapping[str, Tensor]) -> bytes:
        from safetensors.torch import save

        return save({k: v.detach().contiguous().cpu() for k, v in delta.items()})

    def decode(self, data: bytes) -> dict[str, Tensor]:
        """The delta in `data`, checked (`check_delta`); PayloadError on anything malformed."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        if not isinstance(data, bytes | bytearray):
            raise PayloadError(f"a delta payload is bytes, got {type(data).__name__}")
        if len(data) > self.max_bytes:
            raise PayloadError(f"delta payload of {len(data)} bytes exceeds {self.max_bytes}")
        try:
            raw = load(bytes(data))
        except (SafetensorError, ValueError, RuntimeError, OSError) as e:
            raise PayloadError(f"delta payload is not valid safetensors: {e}") from None
        return check_delta(raw, self.reference)
