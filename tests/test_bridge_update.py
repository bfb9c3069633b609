"""The bridged path inside the update (docs/math.md §16): with one tokenizer and identical
tokens, marking a peer's batch as bridged changes nothing where the bridged form is the exact
one, and micro-batches change nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ftis.core.bridge import sequence_logprob
from tests.test_train import _batch, _grads_after_update, _node


def _as_bridged(batch):
    """The same sequences as the bridged path would deliver them with one tokenizer: the
    receiver's tokens equal the sender's, the sender's totals are the per-token sums."""
    return dataclasses.replace(
        batch,
        sampler_logprobs=torch.zeros_like(batch.sampler_logprobs),
        bridged=torch.ones(batch.num_sequences, dtype=torch.bool),
        bridge_sampler_logprob=sequence_logprob(batch.sampler_logprobs, batch.mask),
        bridge_sampler_length=batch.lengths.clone(),
    )


def _peer_batch(node):
    batch = _batch(node)
    shift = torch.linspace(0.0, 0.3, batch.num_sequences)[:, None]
    batch.sampler_logprobs = batch.sampler_logprobs - shift * batch.mask  # off-policy
    batch.generator = torch.ones_like(batch.generator)  # a peer's
    return batch


def test_hacpo_gradient_is_the_exact_paths_on_identical_tokens():
    # HACPO's peer ratio is sequence-level on both paths: equal up to float rounding
    node = _node("hacpo")
    batch = _peer_batch(node)
    adv = torch.linspace(-1, 1, batch.num_sequences)
    own = torch.zeros(batch.num_sequences, dtype=torch.bool)
    kw = dict(own=own)
    node.cfg = node.cfg.model_copy(
        update={"loss": node.cfg.loss.model_copy(update={"hacpo_clip_lower": 0.0})}
    )
    exact = _grads_after_update(node, batch, adv, mb=0, **kw)
    bridged = _grads_after_update(node, _as_bridged(batch), adv, mb=0, **kw)
    assert max(float(g.abs().max()) for g in exact) > 1e-4  # a real gradient
    for a, b in zip(exact, bridged):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("method", ["f-tis", "nois", "hacpo"])
def test_micro_batches_change_nothing_on_a_mixed_batch(method):
    node = _node(method)
    batch = _peer_batch(node)
    bridged = _as_bridged(batch)
    # half exact (own), half bridged
    half = torch.arange(batch.num_sequences) % 2 == 0
    mixed = dataclasses.replace(bridged, bridged=half)
    mixed.sampler_logprobs = torch.where(half[:, None], 0.0, batch.sampler_logprobs)
    adv = torch.linspace(-1, 1, batch.num_sequences)
    own = ~half
    whole = _grads_after_update(node, mixed, adv, mb=0, own=own)
    for mb in (1, 5):
        split = _grads_after_update(node, mixed, adv, mb=mb, own=own)
        for a, b in zip(whole, split):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_bridged_tis_weights_are_reported():
    # F-TIS on identical tokens: the reported mean weight is the mean over the sequences that
    # ran of min(exp(S_recv - S_send), C), C = 2 (S_send lowered by 0..0.3 per token)
    from ftis.train import update as update_mod
    from tests.test_train import TASK

    node = _node("f-tis")  # the weights are computed before the step
    batch = _peer_batch(node)
    adv = torch.linspace(-1, 1, batch.num_sequences)
    m = update_mod.update(
        node, TASK, _as_bridged(batch), adv, loss_cfg=node.cfg.loss, micro_batch_size=0
    )
    active = adv != 0
    assert m["bridge_sequences"] == float(active.sum())
    # the receiver is the sampler here (same node, scored before its step): S_recv = the
    # unshifted sum, so S_recv - S_send = shift * length
    shift = torch.linspace(0.0, 0.3, batch.num_sequences)
    expected = torch.exp(shift * batch.lengths).clamp(max=2.0)[active].mean()
    assert m["bridge_weight_mean"] == pytest.approx(float(expected), rel=1e-4)


def test_hacpo_clipping_counts_bridged_peers_as_the_exact_path_does():
    # identical tokens, every sequence a peer's: the sequence ratio s_i = exp(shift_i) lies in
    # [1, 1.35], so every sequence with shift > 0 falls outside HACPO's window [lower, 1]; both
    # paths must count the same peers and the same clipped ones
    from ftis.train import update as update_mod
    from tests.test_train import TASK

    adv = None
    out = {}
    for path in ("exact", "bridged"):
        node = _node("hacpo")  # the same initial weights for both paths
        batch = _peer_batch(node)
        adv = torch.linspace(-1, 1, batch.num_sequences)
        own = torch.zeros(batch.num_sequences, dtype=torch.bool)
        b = batch if path == "exact" else _as_bridged(batch)
        out[path] = update_mod.update(
            node, TASK, b, adv, loss_cfg=node.cfg.loss, micro_batch_size=0, own=own
        )
    active = adv != 0
    shift = torch.linspace(0.0, 0.3, len(adv))
    expected = float(((shift > 1e-6) & active).sum() / active.sum())
    assert 0 < expected < 1
    for path in ("exact", "bridged"):
        assert out[path]["peer_frac"] == pytest.approx(1.0), path
        assert out[path]["peer_clipped_frac"] == pytest.approx(expected), path
    assert out["bridged"]["bridge_sequences"] == float(active.sum())
