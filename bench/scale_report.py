"""Markdown of the realistic-scale section (bench/scale.py): every number from the run."""

from __future__ import annotations


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _x(x: float) -> str:
    return f"{x:.2f}x"


def _lengths(s: dict) -> list[int]:
    return list(s["config"]["lengths"])


def _floor_words(floor: float, baseline: float, what: str) -> str:
    """'0.53x TRL's step (the 0.5 target is below it)' or, when the floor is under 0.5x, how
    much time everything besides the matmuls may take to meet it."""
    r = floor / baseline
    if r >= 0.5:
        return f"{r:.2f}x {what} (the 0.5 target is below even that)"
    return (
        f"{r:.2f}x {what} (0.5x would leave {0.5 * baseline - floor:.2f} s for everything "
        "besides the matmuls: attention over the KV cache, norms, activations, sampling, Python)"
    )


def _ablation_words(s: dict, lens: list[int], ratio: str, what: str) -> str | None:
    """'<what> (1.088 at 64 tokens, 0.777 at 256 tokens: slower at 64 tokens, faster at 256
    tokens)' from the ablation's measured ratios (ftis's choice / the replaced one), or None when
    it was not measured."""
    pts = [
        (T, s[f"len{T}_rollout_time_ratio_{ratio}"])
        for T in lens
        if f"len{T}_rollout_time_ratio_{ratio}" in s
    ]
    if not pts:
        return None
    values = ", ".join(f"{r:.3f} at {T} tokens" for T, r in pts)
    groups: dict[str, list[int]] = {}
    for T, r in pts:  # in order of length
        word = "faster" if round(r, 3) < 1 else "slower" if round(r, 3) > 1 else "as fast"
        groups.setdefault(word, []).append(T)
    verdict = ", ".join(
        f"{word} at {' and '.join(str(T) for T in ts)} tokens" for word, ts in groups.items()
    )
    return f"{what} ({values}: {verdict})"


def _ablations_sentence(s: dict, lens: list[int]) -> str:
    """What the rollout's ablation columns measured, as measured: each of ftis's two sampler
    choices is faster than what it replaces at some lengths and may be slower at others."""
    parts = [
        w
        for w in (
            _ablation_words(
                s,
                lens,
                "dynamic_cache",
                "the preallocated KV cache against transformers' DynamicCache, which grows by "
                "`aten::cat`",
            ),
            _ablation_words(
                s, lens, "forward_step", "the direct decode step against `forward` per step"
            ),
        )
        if w is not None
    ]
    once = (
        "ftis also runs each prompt once per group in sampling and in the update (no column "
        "measures that)."
    )
    if not parts:
        return once
    return (
        "The rollout's ablation columns time two of ftis's sampler choices against what they "
        "replace (a ratio below 1: ftis's choice is faster): " + " and ".join(parts) + ". " + once
    )


def scale_summary_rows(s: dict) -> list[str]:
    lens = _lengths(s)

    def both(key: str, fmt=lambda x: f"{x:.3f}") -> str:
        return " / ".join(fmt(s[f"len{T}_{key}"]) for T in lens)

    at = " / ".join(str(T) for T in lens)
    name = f"`{s['config']['preset']}` ({s['params_m']:.1f}M)"
    rows = [
        f"| training step, ftis / TRL GRPOTrainer, {name} at {at} tokens (CPU time; section g) "
        f"| {both('trl_step_time_ratio')} | <= 0.5 |",
        f"| rollout, ftis sampler / HF `generate(output_logits=True)` one pass, {name} at {at} "
        f"tokens | {both('rollout_time_ratio_one_pass')} | <= 0.5 |",
        f"| update phase utilisation of the measured matmul peak, {name} at {at} tokens "
        f"| {both('update_mfu', _pct)} | >= 50% |",
    ]
    if f"len{lens[0]}_rollout_floor_multiple" in s:
        rows += [
            f"| rollout CPU time / its matmul floor (same run), {name} at {at} tokens"
            + (
                f" (against the streamed floor, weights read from memory every step: "
                f"{both('rollout_streamed_floor_multiple', _x)}; against that plus attention's "
                f"floor over the KV cache: {both('rollout_decode_floor_multiple', _x)})"
                if f"len{lens[0]}_rollout_decode_floor_multiple" in s
                else ""
            )
            + f" | {both('rollout_floor_multiple', _x)} | <= 1.25 |",
            f"| training step CPU time / its matmul floor (sampling + update floors), {name} at "
            f"{at} tokens (update alone: {both('update_floor_multiple', _x)}) "
            f"| {both('step_floor_multiple', _x)} | <= 1.15 |",
        ]
    h = f"len{lens[0]}_"
    if h + "trl_step_time_ratio_bf16" in s:
        rows.append(
            f"| training step, ftis / TRL GRPOTrainer, both bf16, {name} at {lens[0]} tokens "
            f"(CPU time; section g) | {s[h + 'trl_step_time_ratio_bf16']:.3f} | - |"
        )
    return rows


def _multiples(s: dict, p: str) -> str:
    keys = ("rollout_floor_multiple", "update_floor_multiple", "step_floor_multiple")
    if p + keys[0] not in s:  # results from before the multiples were recorded
        return "-"
    return " / ".join(_x(s[p + k]) for k in keys)


def scale_section(s: dict) -> list[str]:
    c, lens = s["config"], _lengths(s)
    n = c["prompts"] * c["group"]
    lines = [
        "",
        f"## g. Realistic scale: `{c['preset']}` ({s['params_m']:.1f}M parameters)",
        "",
        f"Random init (identical weights on every side: same preset and seed), {c['prompts']} "
        f"prompts x G = {c['group']} = {n} completions, every completion exactly the given "
        "length (EOS suppressed on every side), temperature 1, AdamW lr 1e-5, micro-batches of "
        f"{c['micro_batch']} sequences, one optimizer step per generation round (TRL: "
        f"per-device batch {c['micro_batch']}, gradient accumulation {n // c['micro_batch']}). "
        "Reward: the share of digits in the completion (a random model never solves the task; "
        "this one varies within every group on both sides). Each measured run is a fresh process "
        f"({c['rounds']} per side, alternating; {c['warmup']} warm-up step(s), then {c['steps']} "
        "measured) that reports its own peak RSS (VmHWM). Times are CPU seconds of the "
        "single-threaded process (the work itself, whatever else the machine runs); the wall-clock "
        f"ratio is beside it. Load average (1 min) {s['load_before']:.1f} at the start, "
        f"{s['load_after']:.1f} at the end. Module: `bench/scale.py`.",
        "",
        "| length | ftis step (s) | sample | score | update | TRL step (s) | ratio | ratio (wall) | peak RSS ftis / TRL (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for T in lens:
        p = f"len{T}_"
        lines.append(
            f"| {T} | {s[p + 'ftis_step_cpu_s']:.2f} | {s[p + 'ftis_sample_cpu_s']:.2f} | "
            f"{s[p + 'ftis_score_cpu_s']:.3f} | {s[p + 'ftis_update_cpu_s']:.2f} | "
            f"{s[p + 'trl_step_cpu_s']:.2f} | **{s[p + 'trl_step_time_ratio']:.3f}** | "
            f"{s[p + 'trl_step_time_ratio_wall']:.3f} | "
            f"{s[p + 'ftis_step_peak_rss_mb']:.0f} / {s[p + 'trl_step_peak_rss_mb']:.0f} |"
        )
    h = f"len{lens[0]}_"
    if h + "trl_step_time_ratio_bf16" in s:
        lines += [
            "",
            f"bf16, at {lens[0]} tokens, one process per side: ftis with `model.compute_dtype: "
            "bfloat16` and TRL with `bf16=True`, both mixed precision (f32 weights and AdamW, "
            "forward passes under bf16 autocast; ftis samples and takes log-probs in f32 from "
            "the bf16 logits). "
            f"ftis {s[h + 'bf16_ftis_step_cpu_s']:.2f} s (sample "
            f"{s[h + 'bf16_ftis_sample_cpu_s']:.2f}, update {s[h + 'bf16_ftis_update_cpu_s']:.2f}), "
            f"TRL {s[h + 'bf16_trl_step_cpu_s']:.2f} s: ratio "
            f"**{s[h + 'trl_step_time_ratio_bf16']:.3f}**; the bf16 step is "
            f"{s[h + 'bf16_step_floor_multiple']:.2f}x its bf16 matmul floor "
            f"({s[h + 'bf16_update_matmul_floor_s'] + s[h + 'bf16_sample_matmul_floor_s']:.2f} s; "
            f"bf16 matmul peak {s[h + 'bf16_matmul_peak_flops'] / 1e9:.1f} GFLOP/s against "
            f"{s[h + 'matmul_peak_flops'] / 1e9:.1f} in f32).",
        ]
    lines += [
        "",
        "Rollout with per-token log-probs, the same prompts and lengths: ftis's sampler; HF "
        "`generate(output_logits=True)` with the log-probs gathered from the returned logits "
        "(one pass, the strongest plain-HF baseline); HF `generate` then a scoring forward pass; "
        "and, as ablations, ftis's sampler with transformers' `DynamicCache` instead of its "
        "preallocated one, and with the model's `forward` called for every decode step instead "
        "of its direct decode step (`ftis.rollout.decode`: the same layers, bit-identical "
        "logits, without `forward`'s per-call mask construction). Tokens/s: completion tokens "
        "per CPU second.",
        "",
        "| length | ftis (s) | HF one pass (s) | HF generate + score (s) | ftis, DynamicCache (s) | ftis, forward per step (s) | ratio one pass | ratio two pass | preallocated / dynamic cache | direct step / forward | tokens/s ftis / one pass | ratio one pass (wall) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def ablation(p: str, method: str, ratio: str) -> tuple[str, str]:
        if p + f"{method}_cpu_s" not in s:
            return "-", "-"
        return f"{s[p + f'{method}_cpu_s']:.2f}", f"{s[p + f'time_ratio_{ratio}']:.3f}"

    for T in lens:
        p = f"len{T}_rollout_"
        dyn, dyn_ratio = ablation(p, "ftis_dynamic_cache", "dynamic_cache")
        fwd, fwd_ratio = ablation(p, "ftis_forward", "forward_step")
        lines.append(
            f"| {T} | {s[p + 'ftis_cpu_s']:.2f} | {s[p + 'hf_one_pass_cpu_s']:.2f} | "
            f"{s[p + 'hf_two_pass_cpu_s']:.2f} | {dyn} | {fwd} | "
            f"**{s[p + 'time_ratio_one_pass']:.3f}** | {s[p + 'time_ratio_two_pass']:.3f} | "
            f"{dyn_ratio} | {fwd_ratio} | {s[p + 'ftis_tokens_per_s']:.0f} / "
            f"{s[p + 'hf_one_pass_tokens_per_s']:.0f} | {s[p + 'time_ratio_one_pass_wall']:.3f} |"
        )
    lines += [
        "",
        "Utilisation. The peak is the best dense matmul throughput (FLOP/s per CPU second) "
        "measured in this run with torch at the model's linear shapes: the update's micro-batch "
        f"({c['micro_batch']} x length tokens; forward and both backward products) and, for "
        f"decoding, {n} rows. Model FLOPs: 2 per weight per token, 2 d V per scored position, "
        "4 d per (query, key) pair per layer; the update is 3x its forward (unique prompts once, "
        "completions on their cache). `matmul floor`: the time the phase's linear matmuls alone "
        "take at their measured speed, each shape timed alone and repeatedly, so with its "
        "weight in the CPU's caches. `streamed floor`: a rollout's linear matmuls run as its "
        "decode steps run them, every weight of the model once per step in the model's order "
        "on its own tensor, so the weights come from memory as they must in sampling (the "
        "model's weights do not fit in the caches); what a sampler doing nothing but its "
        "matmuls would take on this machine. `attention floor`: a decode step's two attention "
        "products (q K^T, weights times V) over a KV cache of the rollout's mean context, every "
        "layer on its own cache, or torch's SDPA kernel where faster, times the length: every "
        "step must read the whole cache.",
        "",
        "| length | matmul peak (GFLOP/s) | at decode shapes | update GFLOP/s | update utilisation | update s / matmul floor s | sampling GFLOP/s | sampling utilisation (of peak / of decode-shape peak) | sampling s / matmul floor s / streamed floor s / attention floor s | floor multiple: rollout / update / step | rollout / streamed floor / streamed + attention floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for T in lens:
        p = f"len{T}_"
        streamed = p + "sample_attention_floor_s" in s
        lines.append(
            f"| {T} | {s[p + 'matmul_peak_flops'] / 1e9:.1f} | {s[p + 'matmul_decode_peak_flops'] / 1e9:.1f} | "
            f"{s[p + 'update_flops_per_s'] / 1e9:.1f} | **{_pct(s[p + 'update_mfu'])}** | "
            f"{s[p + 'ftis_update_cpu_s']:.2f} / {s[p + 'update_matmul_floor_s']:.2f} | "
            f"{s[p + 'sample_flops_per_s'] / 1e9:.1f} | {_pct(s[p + 'sample_mfu'])} / "
            f"{_pct(s[p + 'sample_mfu_decode_shapes'])} | "
            f"{s[p + 'rollout_ftis_cpu_s']:.2f} / {s[p + 'sample_matmul_floor_s']:.2f} / "
            + (
                f"{s[p + 'sample_streamed_floor_s']:.2f} / {s[p + 'sample_attention_floor_s']:.2f}"
                if streamed
                else "- / -"
            )
            + f" | {_multiples(s, p)} | "
            + (
                f"{_x(s[p + 'rollout_streamed_floor_multiple'])} / "
                f"{_x(s[p + 'rollout_decode_floor_multiple'])}"
                if streamed
                else "-"
            )
            + " |"
        )
    pr = s["profile"]
    lines += [
        "",
        "## h. Hot spots (profiled in this run)",
        "",
        f"torch.profiler over one ftis step of the configuration above at {c['profile_length']} "
        "tokens (after a warm-up step), sampling and update profiled apart. Shares are of the "
        "phase's wall time (the profiler adds its own overhead); `outside torch ops` is Python "
        "and transformers glue between ops.",
        "",
        "| phase | wall (s) | matmuls | attention | other torch ops | outside torch ops |",
        "|---|---|---|---|---|---|",
    ]
    for ph in ("sample", "update"):
        q = pr[ph]
        lines.append(
            f"| {ph} | {q['s']:.2f} | {_pct(q['matmul_share'])} | {_pct(q['attention_share'])} | "
            f"{_pct(q['other_ops_share'])} | {_pct(q['outside_ops_share'])} |"
        )
    for ph in ("sample", "update"):
        lines += ["", f"Top ops, {ph}:", "", "| op | calls | self s | share |", "|---|---|---|---|"]
        for o in pr[ph]["top_ops"]:
            lines.append(f"| `{o['op']}` | {o['calls']} | {o['s']:.3f} | {_pct(o['share'])} |")
    head = lens[0]
    h = f"len{head}_"
    floor_step = s[h + "update_matmul_floor_s"] + s[h + "sample_matmul_floor_s"]
    sm, um = pr["sample"]["matmul_share"], pr["update"]["matmul_share"]
    lines += [
        "",
        "What this says about the targets: ftis and its baselines run the same model on the same "
        f"tokens, so the same matmuls. Matmuls are {_pct(sm)} of ftis's sampling and {_pct(um)} "
        "of its update here, and they already run near the measured peak (the tables above), so "
        "a ratio of 0.5 against a baseline doing the same matmuls would need that baseline to "
        "spend at least as long again outside them. The one-pass baseline does not: at "
        f"{head} tokens ftis's rollout takes {s[f'len{head}_rollout_time_ratio_one_pass']:.2f}x "
        f"its time, and the training step {s[f'len{head}_trl_step_time_ratio']:.2f}x TRL's. "
        "Even a step made of nothing but its linear matmuls at their measured speed "
        f"({floor_step:.2f} s at {head} tokens, attention and everything else free) would be "
        f"{_floor_words(floor_step, s[h + 'trl_step_cpu_s'], 'TRL' + chr(39) + 's step')}, and "
        "a rollout made of its matmuls alone "
        f"{_floor_words(s[h + 'sample_matmul_floor_s'], s[h + 'rollout_hf_one_pass_cpu_s'], 'the one-pass baseline')}. "
        "Below that takes fewer or cheaper FLOPs (bf16 weights, a smaller KV cache), which would "
        "no longer be the same computation as the baselines'. " + _ablations_sentence(s, lens),
        "",
    ]
    for T in lens:
        p = f"len{T}_"
        if p + "sample_attention_floor_s" not in s:
            continue
        ro, fl = s[p + "rollout_ftis_cpu_s"], s[p + "sample_matmul_floor_s"]
        st, at = s[p + "sample_streamed_floor_s"], s[p + "sample_attention_floor_s"]
        rest = ro - st - at
        lines += [
            f"The rollout's floor multiple at {T} tokens, read apart: the rollout takes "
            f"{ro:.2f} s against a matmul floor of {fl:.2f} s ({_x(ro / fl)}). Run as a decode "
            f"step must run them, every weight read from memory once per step, the same matmuls "
            f"take {st:.2f} s ({_pct((st - fl) / ro)} of the rollout's time is that trip of the "
            f"weights through memory); attention over the KV cache cannot take less than "
            f"{at:.2f} s ({_pct(at / ro)}). Together {st + at:.2f} s, which the rollout is "
            f"{_x(ro / (st + at))} of; "
            + (
                f"the remaining {rest:.2f} s ({_pct(rest / ro)}) is everything else: norms, "
                "rotary embeddings, activations, sampling, Python, and the matmuls themselves "
                "running slower inside the model than in the floor's loop (section h times "
                "them in place)."
                if rest > 0
                else "nothing measurable is left over these floors (they were measured in "
                "separate processes, each to a few percent)."
            ),
            "",
        ]
    return lines
