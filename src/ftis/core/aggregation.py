"""Server-side aggregation of client updates for federated training (docs/math.md §9, FGRPO).

K clients report a parameter delta each (a dict of tensors: every weight, or LoRA adapters
only), a performance value and a sample count. The server turns them into one weight per client
and applies the weighted sum of the deltas:

    relative-gain (FGRPO, §9.1)   g_k = (P_k - B_k) / max(|B_k|, 1e-8)      `relative_gains`
    floored gain (default, §9.4)  g_k = (P_k - B_k) / max(|B_k|, delta)     `floored_gains`
                                  w   = (1 - floor) softmax(g / tau) + floor / K   `gain_weights`
    fedavg                        w_k = n_k / sum n                          `fedavg_weights`
    uniform                       w_k = 1 / K                                `uniform_weights`
    reward-weighted               w_k = P_k / sum P                          `performance_weights`
    server step                   theta <- theta + eta_s * sum_k w_k Delta_k `combine_deltas`

B_k is client k's baseline: by default its score of the global model it was sent, measured
before its local training in the same round (§9.4), or its own history (`update_baselines`:
EMA, running mean or best so far). A NaN baseline means "unset" (the client has not reported
yet): its gain is 0. `no_gain_weights` is the rule for a round in which no gain is positive.

Why relative gains: multiplying client k's rewards by c > 0 multiplies P_k and (being a history
of P_k) B_k by c, so g_k and hence every weight is unchanged; weights proportional to P_k are
not (§9.2).

Pure torch: tensors and floats in, tensors out; no config objects, no I/O, no logging.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

GAIN_EPS = 1e-8  # the floor of |B_k| in the relative gain (architecture.md §5b)
BaselineRule = Literal["ema", "mean", "best"]
BASELINE_RULES: tuple[str, ...] = ("ema", "mean", "best")


def _vector(x: Tensor | Sequence[float], name: str) -> Tensor:
    # Weights are few: float64 keeps them (and the hand-derived tests) exact to ~1e-16.
    if isinstance(x, Tensor):
        t = x.detach().to(device="cpu", dtype=torch.float64)
    else:  # straight to float64: a float32 detour would round Python floats
        t = torch.as_tensor(x, dtype=torch.float64)
    if t.ndim != 1:
        raise ValueError(f"{name} must be a vector (K,), got shape {tuple(t.shape)}")
    return t


# ---- gains ---------------------------------------------------------------------------------


def _perf_and_baseline(
    perf: Tensor | Sequence[float], baseline: Tensor | Sequence[float]
) -> tuple[Tensor, Tensor]:
    """Both as float64 vectors of one shape; perf must be finite (a NaN baseline is unset)."""
    p, b = _vector(perf, "perf"), _vector(baseline, "baseline")
    if p.shape != b.shape:
        raise ValueError(f"perf {tuple(p.shape)} and baseline {tuple(b.shape)} differ in shape")
    if not bool(torch.isfinite(p).all()):
        raise ValueError(f"perf must be finite, got {p.tolist()}")
    return p, b


def _divided_gains(p: Tensor, b: Tensor, floor: float) -> Tensor:
    """(p - b) / max(|b|, floor); 0 where the baseline is unset (NaN)."""
    unset = torch.isnan(b)
    b0 = torch.where(unset, torch.zeros_like(b), b)
    g = (p - b0) / b0.abs().clamp_min(floor)
    return torch.where(unset, torch.zeros_like(g), g)


def relative_gains(perf: Tensor | Sequence[float], baseline: Tensor | Sequence[float]) -> Tensor:
    """(K,) relative performance gains: g_k = (perf_k - baseline_k) / max(|baseline_k|, 1e-8).

    A NaN baseline is an unset one (the client's first report): its gain is 0. perf must be
    finite (the server rejects a client with a non-finite performance before this). Returns
    float64.
    """
    return _divided_gains(*_perf_and_baseline(perf, baseline), GAIN_EPS)


def floored_gains(
    perf: Tensor | Sequence[float], baseline: Tensor | Sequence[float], *, floor: float
) -> Tensor:
    """(K,) relative gains with a floored denominator: g_k = (perf_k - baseline_k) /
    max(|baseline_k|, floor) (docs/math.md §9.4).

    `relative_gains` divides by max(|B_k|, 1e-8), so a client moving from 0 to 1/64 gets a gain
    of ~1e6 and softmax hands it the round. Here a baseline below `floor` (in the units of the
    performance signal) divides by `floor` instead: the gain is bounded by |P_k - B_k| / floor,
    and is the plain relative gain (scale-invariant) whenever |B_k| >= floor. A NaN baseline
    (unset) gives 0. Returns float64.
    """
    if not floor > 0 or not math.isfinite(floor):
        raise ValueError(f"floor must be a positive number, got {floor}")
    return _divided_gains(*_perf_and_baseline(perf, baseline), floor)


def log_ratio_gains(
    perf: Tensor | Sequence[float], baseline: Tensor | Sequence[float], *, eps: float = 1e-8
) -> Tensor:
    """(K,) log-ratio gains g_k = log(max(perf_k, eps) / max(baseline_k, eps)) (an option, §9.1).

    Scale-invariant like `relative_gains`, symmetric in improvement and decline, and bounded by
    |log eps| when a value is 0. Meant for non-negative performance (rewards >= 0): values below
    eps are treated as eps. A NaN baseline (unset) gives 0. Returns float64.
    """
    p, b = _perf_and_baseline(perf, baseline)
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    unset = torch.isnan(b)
    g = torch.log(p.clamp_min(eps)) - torch.log(torch.where(unset, p, b).clamp_min(eps))
    return torch.where(unset, torch.zeros_like(g), g)


# ---- weights -------------------------------------------------------------------------------


def _check_floor(floor: float) -> None:
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor must be in [0, 1], got {floor}")


def gain_weights(
    g: Tensor | Sequence[float], temperature: float = 1.0, floor: float = 0.0
) -> Tensor:
    """(K,) aggregation weights from gains: w = (1 - floor) softmax(g / temperature) + floor / K.

    floor mixes in a uniform share so that no participating client is ignored entirely; the
    weights are positive when floor > 0 and always sum to 1. Returns float64.
    """
    gv = _vector(g, "g")
    if not temperature > 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a positive number, got {temperature}")
    _check_floor(floor)
    if gv.numel() == 0:
        return gv
    if not bool(torch.isfinite(gv).all()):
        raise ValueError(f"gains must be finite, got {gv.tolist()}")
    return (1.0 - floor) * torch.softmax(gv / temperature, dim=0) + floor / gv.numel()


def clipped_positive_weights(g: Tensor | Sequence[float], floor: float = 0.0) -> Tensor:
    """(K,) weights proportional to max(g_k, 0), uniform when no gain is positive, then mixed
    with floor / K like `gain_weights` (an option, §9.1). Returns float64."""
    gv = _vector(g, "g")
    _check_floor(floor)
    if gv.numel() == 0:
        return gv
    if not bool(torch.isfinite(gv).all()):
        raise ValueError(f"gains must be finite, got {gv.tolist()}")
    pos = gv.clamp_min(0.0)
    total = pos.sum()
    w = pos / total if total > 0 else torch.full_like(gv, 1.0 / gv.numel())
    return (1.0 - floor) * w + floor / gv.numel()


NoGainRule = Literal["fedavg", "skip", "weights"]
NO_GAIN_RULES: tuple[str, ...] = ("fedavg", "skip", "weights")


def no_gain_weights(
    g: Tensor | Sequence[float],
    w: Tensor | Sequence[float],
    num_examples: Tensor | Sequence[float],
    *,
    rule: NoGainRule = "fedavg",
) -> Tensor:
    """(K,) the weights of a round, given its gains g and gain weights w (docs/math.md §9.4).

    While some gain is > 0, w is returned unchanged. When none is (no client's update raised
    its own score), `rule` decides: fedavg = data-size weights n_k / sum n (the step is taken,
    but nobody is favoured on a signal that says nothing); skip = all zeros (theta is left
    unchanged this round); weights = w unchanged (the step at full size, the rule before §9.4).
    Returns float64.
    """
    gv, wv = _vector(g, "g"), _vector(w, "w")
    if gv.shape != wv.shape:
        raise ValueError(f"gains {tuple(gv.shape)} and weights {tuple(wv.shape)} differ")
    if rule not in NO_GAIN_RULES:
        raise ValueError(
            f"unknown no-gain rule {rule!r}; choose one of: {', '.join(NO_GAIN_RULES)}"
        )
    if gv.numel() == 0 or bool((gv > 0).any()) or rule == "weights":
        return wv
    if rule == "skip":
        return torch.zeros_like(wv)
    return fedavg_weights(num_examples)


def fedavg_weights(num_examples: Tensor | Sequence[float]) -> Tensor:
    """(K,) FedAvg's data-size weights n_k / sum n. Counts must be positive. Returns float64."""
    n = _vector(num_examples, "num_examples")
    if n.numel() and not bool((torch.isfinite(n) & (n > 0)).all()):
        raise ValueError(f"sample counts must be finite and > 0, got {n.tolist()}")
    return n / n.sum() if n.numel() else n


def uniform_weights(k: int) -> Tensor:
    """(k,) equal weights 1 / k (float64)."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return (
        torch.full((k,), 1.0 / k, dtype=torch.float64) if k else torch.zeros(0, dtype=torch.float64)
    )


def performance_weights(perf: Tensor | Sequence[float]) -> Tensor:
    """(K,) reward-weighted averaging: w_k = max(P_k, 0) / sum max(P, 0), uniform when no P_k is
    positive. Not scale-invariant: the comparison rule of §9.2. Returns float64."""
    p = _vector(perf, "perf")
    if p.numel() and not bool(torch.isfinite(p).all()):
        raise ValueError(f"perf must be finite, got {p.tolist()}")
    pos = p.clamp_min(0.0)
    total = pos.sum()
    if p.numel() == 0:
        return p
    return pos / total if total > 0 else torch.full_like(p, 1.0 / p.numel())


def mix_weights(w: Tensor, other: Tensor, amount: float) -> Tensor:
    """(1 - amount) w + amount other: e.g. relative-gain weights mixed with data-size weights."""
    if not 0.0 <= amount <= 1.0:
        raise ValueError(f"amount must be in [0, 1], got {amount}")
    a, b = _vector(w, "w"), _vector(other, "other")
    if a.shape != b.shape:
        raise ValueError(f"weights {tuple(a.shape)} and {tuple(b.shape)} differ in shape")
    return (1.0 - amount) * a + amount * b


# ---- baselines -----------------------------------------------------------------------------


def update_baselines(
    baseline: Tensor | Sequence[float],
    perf: Tensor | Sequence[float],
    *,
    rule: BaselineRule = "ema",
    momentum: float = 0.9,
    count: Tensor | Sequence[float] | None = None,
) -> Tensor:
    """(K,) baselines after this round's reports (§9.1). NaN = unset: it becomes perf.

    ema:  B <- momentum * B + (1 - momentum) * P
    mean: B <- B + (P - B) / (count + 1), count = the reports B already averages (>= 1)
    best: B <- max(B, P)
    Every rule is positively homogeneous: scaling B and P by c > 0 scales the result by c.
    """
    b, p = _vector(baseline, "baseline"), _vector(perf, "perf")
    if b.shape != p.shape:
        raise ValueError(f"baseline {tuple(b.shape)} and perf {tuple(p.shape)} differ in shape")
    if not bool(torch.isfinite(p).all()):
        raise ValueError(f"perf must be finite, got {p.tolist()}")
    unset = torch.isnan(b)
    if rule == "ema":
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum must be in [0, 1], got {momentum}")
        new = momentum * b + (1.0 - momentum) * p
    elif rule == "mean":
        if count is None:
            raise ValueError("rule 'mean' needs count (the reports each baseline averages)")
        c = _vector(count, "count")
        if c.shape != b.shape:
            raise ValueError(f"count {tuple(c.shape)} and baseline {tuple(b.shape)} differ")
        new = b + (p - b) / (c.clamp_min(1.0) + 1.0)
    elif rule == "best":
        new = torch.maximum(b, p)
    else:
        raise ValueError(
            f"unknown baseline rule {rule!r}; choose one of: {', '.join(BASELINE_RULES)}"
        )
    return torch.where(unset, p, new)


# ---- deltas --------------------------------------------------------------------------------


def combine_deltas(
    deltas: Sequence[Mapping[str, Tensor]], weights: Tensor | Sequence[float]
) -> dict[str, Tensor]:
    """sum_k weights_k * deltas_k, tensor by tensor (same names, shapes in every delta).

    Deltas may hold every weight or LoRA adapters only; the sum is accumulated in float32 (or
    the deltas' own dtype if wider) and returned in each reference tensor's dtype.
    """
    w = _vector(weights, "weights")
    if len(deltas) != w.numel():
        raise ValueError(f"{len(deltas)} deltas but {w.numel()} weights")
    if not deltas:
        raise ValueError("no deltas to combine")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"weights must be finite, got {w.tolist()}")
    names = list(deltas[0])
    for k, d in enumerate(deltas[1:], start=1):
        if set(d) != set(names):
            raise ValueError(
                f"delta {k} has tensors {sorted(set(d) ^ set(names))} that delta 0 lacks or has"
            )
    out: dict[str, Tensor] = {}
    for name in names:
        ref = deltas[0][name]
        acc_dtype = torch.promote_types(ref.dtype, torch.float32)
        acc = torch.zeros(ref.shape, dtype=acc_dtype, device=ref.device)
        for k, d in enumerate(deltas):
            t = d[name]
            if t.shape != ref.shape:
                raise ValueError(
                    f"tensor {name!r}: delta {k} has shape {tuple(t.shape)}, delta 0 "
                    f"{tuple(ref.shape)}"
                )
            acc.add_(t.to(device=ref.device, dtype=acc_dtype), alpha=float(w[k]))
        out[name] = acc.to(ref.dtype)
    return out


def apply_delta(
    params: Mapping[str, Tensor], delta: Mapping[str, Tensor], lr: float = 1.0
) -> dict[str, Tensor]:
    """theta + lr * delta, tensor by tensor (new tensors; `params` is not modified)."""
    if set(params) != set(delta):
        raise ValueError(f"params and delta differ in tensors: {sorted(set(params) ^ set(delta))}")
    out = {}
    for name, p in params.items():
        d = delta[name]
        if d.shape != p.shape:
            raise ValueError(f"tensor {name!r}: delta {tuple(d.shape)} vs params {tuple(p.shape)}")
        acc_dtype = torch.promote_types(p.dtype, torch.float32)
        out[name] = (p.to(acc_dtype) + lr * d.to(device=p.device, dtype=acc_dtype)).to(p.dtype)
    return out


def delta_norm(delta: Mapping[str, Tensor]) -> float:
    """Global L2 norm of a delta (all tensors together), as a float."""
    total = 0.0
    for t in delta.values():
        total += float(t.detach().double().pow(2).sum())
    return math.sqrt(total)
