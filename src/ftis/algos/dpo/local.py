"""Local DPO training: what one agent does between two communications (docs/dpo.md).

`LocalDPO` runs E optimizer steps of DPO on one model with its own optimizer and pairs, against
a frozen reference (the starting weights), and evaluates held-out pairs. It knows nothing of
configs, graphs or transports, so every distributed variant reuses it as it is: the gossip
algorithm here (`ftis.algos.dpo.algorithm`), a federated (Flower) client, a centralized
baseline on the union of the data.

    local = LocalDPO(model, optimizer, Reference.frozen_copy(model), pairs, pad_id=...,
                     beta=0.1, batch_size=4, seed=0, salt="agent-a")
    metrics = local.train(num_steps=E, first=k)      # optimizer steps k .. k+E-1 of this agent
    metrics = local.evaluate(heldout)                 # eval/preference_accuracy, ...

Per step: a batch of B pairs (step k of an endless sequence of seeded shuffles of the pairs, so
that a resumed run draws what the uninterrupted one did), the reference's summed log-probs once
for the batch (no gradient), the policy's with gradient, `ftis.core.dpo.dpo_loss`, clip, step.
A step whose loss or gradient is not finite is skipped and counted.
"""

from __future__ import annotations

import copy
import hashlib
import math
from contextlib import nullcontext

import torch

from ftis.core.dpo import dpo_loss
from ftis.models.logprobs import completion_logprobs
from ftis.preferences.tokens import PreferenceBatch, TokenizedPairs, collate

_EVAL_CHUNK = 64  # pairs per forward pass in evaluation


def summed_logprobs(model: torch.nn.Module, batch: PreferenceBatch) -> torch.Tensor:
    """(2B,) float32: each row's summed log-probs over its scored tokens (the response, or
    prompt + response with include_prompt)."""
    lp = completion_logprobs(
        model,
        prompt_ids=batch.prompt_ids,
        prompt_mask=batch.prompt_mask,
        completion_ids=batch.completion_ids,
        completion_mask=batch.completion_mask,
    )
    return (lp * batch.completion_mask.to(lp.device)).sum(-1)


class Reference:
    """The frozen reference policy: the starting weights, never trained.

    `frozen_copy(model)` copies a full model (call it before any step); for a peft (LoRA) model
    `adapters_off(model)` scores with the adapters disabled, which is the starting model when
    the adapters start at zero (peft's default) and costs no memory. `digest()` fingerprints the
    weights, so that a resumed run can check it rebuilt the same reference.
    """

    def __init__(self, model: torch.nn.Module, *, adapters_off: bool) -> None:
        self.model = model
        self._adapters_off = adapters_off

    @classmethod
    def frozen_copy(cls, model: torch.nn.Module) -> Reference:
        ref = copy.deepcopy(model)
        ref.requires_grad_(False)
        ref.eval()
        return cls(ref, adapters_off=False)

    @classmethod
    def adapters_off(cls, model: torch.nn.Module) -> Reference:
        if not hasattr(model, "disable_adapter"):
            raise ValueError("adapters_off needs a peft model (with disable_adapter)")
        return cls(model, adapters_off=True)

    def active(self):
        """A context in which `self.model` is the reference (adapters off for LoRA)."""
        return self.model.disable_adapter() if self._adapters_off else nullcontext()

    @torch.no_grad()
    def logprobs(self, batch: PreferenceBatch) -> torch.Tensor:
        with self.active():
            return summed_logprobs(self.model, batch)

    def digest(self) -> str:
        """sha256 (16 hex) of the reference's weights as the reference scores with them."""
        h = hashlib.sha256()
        model = self.model.get_base_model() if self._adapters_off else self.model
        for name, p in sorted(model.state_dict().items()):
            if self._adapters_off and "lora_" in name:
                continue
            h.update(name.encode())
            h.update(p.detach().float().cpu().numpy().tobytes())
        return h.hexdigest()[:16]


def batch_indices(n: int, batch_size: int, step: int, *, seed: int, salt: str) -> list[int]:
    """The pairs of optimizer step `step` (0-based): positions step*B .. step*B+B-1 of the
    concatenation of seeded shuffles of range(n) (epoch e shuffled by (seed, salt, e))."""
    out = []
    perms: dict[int, list[int]] = {}
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch = pos // n
        if epoch not in perms:
            key = hashlib.blake2b(f"ftis-dpo:{seed}:{salt}:{epoch}".encode(), digest_size=8)
            g = torch.Generator().manual_seed(int.from_bytes(key.digest(), "little") >> 1)
            perms[epoch] = torch.randperm(n, generator=g).tolist()
        out.append(perms[epoch][pos % n])
    return out


class LocalDPO:
    """E local DPO steps on one model; see the module docstring.

    Args:
        model: the policy (trained in place); optimizer: over its trainable parameters.
        reference: the frozen starting weights (`Reference`).
        pairs: this agent's training pairs, tokenized.
        pad_id: the tokenizer's pad id. beta: DPO's KL strength. batch_size: pairs per step.
        grad_clip: max global gradient norm. include_prompt: also score prompt tokens.
        sft_weight: adds sft_weight x the chosen responses' mean per-token NLL to the loss
            (RPO); 0 = pure DPO.
        seed, salt: key the batch order (salt: the agent's name, so agents differ).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        reference: Reference,
        pairs: TokenizedPairs,
        *,
        pad_id: int,
        beta: float = 0.1,
        batch_size: int = 4,
        grad_clip: float = 1.0,
        include_prompt: bool = False,
        sft_weight: float = 0.0,
        seed: int = 0,
        salt: str = "",
    ) -> None:
        if len(pairs) == 0:
            raise ValueError("LocalDPO needs at least one training pair")
        self.model = model
        self.optimizer = optimizer
        self.reference = reference
        self.pairs = pairs
        self.pad_id = pad_id
        self.beta = beta
        self.batch_size = batch_size
        self.grad_clip = grad_clip
        self.include_prompt = include_prompt
        self.sft_weight = sft_weight
        self.seed = seed
        self.salt = salt
        self._eval_ref: list[tuple[TokenizedPairs, torch.Tensor]] = []  # (data, ref log-probs)

    def _batch(self, data: TokenizedPairs, indices: list[int]) -> PreferenceBatch:
        return collate(data, indices, pad_id=self.pad_id, include_prompt=self.include_prompt)

    def train(self, num_steps: int, *, first: int) -> dict[str, float]:
        """Optimizer steps first .. first+num_steps-1 (0-based, counted over the agent's whole
        run). Returns means over the steps: loss/dpo, loss/total (with the sft term),
        train/reward_margin, train/reward_accuracy, train/chosen_logprob,
        train/rejected_logprob, train/chosen_nll_per_token, train/grad_norm, and
        train/skipped_steps (non-finite loss or gradient)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        sums: dict[str, float] = {}
        skipped = 0
        self.model.train()
        for k in range(first, first + num_steps):
            idx = batch_indices(len(self.pairs), self.batch_size, k, seed=self.seed, salt=self.salt)
            batch = self._batch(self.pairs, idx)
            ref = self.reference.logprobs(batch)  # once per batch, no gradient
            pol = summed_logprobs(self.model, batch)
            b = batch.num_pairs
            dpo, m = dpo_loss(pol[:b], pol[b:], ref[:b], ref[b:], beta=self.beta)
            nll = -(pol[:b] / batch.completion_mask[:b].sum(-1).to(pol.device)).mean()
            # sft_weight keeps the chosen responses likely (RPO); 0 = pure DPO
            loss = dpo + self.sft_weight * nll if self.sft_weight else dpo
            self.optimizer.zero_grad(set_to_none=True)
            if not torch.isfinite(loss):
                skipped += 1
                continue
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
            if not torch.isfinite(norm):
                self.optimizer.zero_grad(set_to_none=True)
                skipped += 1
                continue
            self.optimizer.step()
            step_metrics = {
                "loss/dpo": float(dpo.detach()),
                "loss/total": float(loss.detach()),
                "train/reward_margin": float(m["reward_margin"]),
                "train/reward_accuracy": float(m["accuracy"]),
                "train/chosen_logprob": float(pol[:b].detach().mean()),
                "train/rejected_logprob": float(pol[b:].detach().mean()),
                "train/chosen_nll_per_token": float(nll.detach()),
                "train/grad_norm": float(norm),
            }
            for key, v in step_metrics.items():
                sums[key] = sums.get(key, 0.0) + v
        done = num_steps - skipped
        out = {key: v / done for key, v in sums.items()} if done else {}
        out["train/skipped_steps"] = float(skipped)
        return out

    @torch.no_grad()
    def evaluate(self, data: TokenizedPairs, *, prefix: str = "eval/") -> dict[str, float]:
        """Held-out pairs: `preference_accuracy` (share of pairs whose chosen response the
        policy gives the higher summed log-prob), `reward_accuracy` (share with a positive DPO
        margin against the reference: 0 at step 0, where policy = reference), `reward_margin`
        and `dpo_loss` (log 2 at step 0). The reference's log-probs of a data set are computed
        once and kept."""
        n = len(data)
        if n == 0:
            return {}
        self.model.eval()
        ref_all = next((r for d, r in self._eval_ref if d is data), None)
        pols, refs = [], []
        for start in range(0, n, _EVAL_CHUNK):
            batch = self._batch(data, list(range(start, min(n, start + _EVAL_CHUNK))))
            pols.append(summed_logprobs(self.model, batch).float().cpu().view(2, -1))
            if ref_all is None:
                refs.append(self.reference.logprobs(batch).float().cpu().view(2, -1))
        self.model.train()
        if ref_all is None:
            ref_all = torch.cat(refs, dim=1)
            self._eval_ref.append((data, ref_all))
        pol = torch.cat(pols, dim=1)
        loss, m = dpo_loss(pol[0], pol[1], ref_all[0], ref_all[1], beta=self.beta)
        return {
            f"{prefix}preference_accuracy": float((pol[0] > pol[1]).float().mean()),
            f"{prefix}reward_accuracy": float(m["accuracy"]),
            f"{prefix}reward_margin": float(m["reward_margin"]),
            f"{prefix}dpo_loss": float(loss) if math.isfinite(float(loss)) else float("nan"),
        }
