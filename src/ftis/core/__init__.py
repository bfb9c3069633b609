"""Pure tensor math: advantages, the policy-loss family with the F-TIS filter, ReCo's weights
and ratio, pass@k.

Imports torch only: no config objects, no I/O, no logging, no torch.distributed.
The math is written out in docs/math.md; code comments cite it by section.
"""

from ftis.core.advantages import flat_group_advantages, group_advantages
from ftis.core.losses import (
    LOSS_METHODS,
    LOSS_TERMS,
    TOKEN_TERMS,
    filter_sequences,
    loss_methods,
    policy_loss,
    register_loss_term,
    resolve_method,
    sequence_divergence,
)
from ftis.core.passk import pass_at_k
from ftis.core.reco import reco_weights, variance_ratio

__all__ = [
    "LOSS_METHODS",
    "LOSS_TERMS",
    "TOKEN_TERMS",
    "filter_sequences",
    "flat_group_advantages",
    "group_advantages",
    "loss_methods",
    "pass_at_k",
    "policy_loss",
    "reco_weights",
    "register_loss_term",
    "resolve_method",
    "sequence_divergence",
    "variance_ratio",
]
