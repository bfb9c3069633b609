"""Rewards: named functions scoring completions, combined with weights.

A reward is configured on the task (`task.reward`) or on one node (`nodes[i].reward`, which wins
for that node); without one a task uses its built-in reward (`default_reward` of its config).

    reward: my_rewards:exact                     # one function, weight 1
    reward: [my_rewards:exact, builtin:gsm8k_format]
    reward:
      - {function: my_rewards:exact, weight: 1.0}
      - {function: ./rewards.py:short, weight: 0.2}   # a file, relative to the working directory
      - {function: trl_rewards:accuracy, batched: true}  # TRL's batched form (usually detected)

A function is `module:function` (imported like $FTIS_PLUGINS: the module must be importable),
`path/to/file.py:function`, or a registered name (`builtin:gsm8k`, ..., `register_reward`).

Two forms (docs/tasks.md, "Rewards"):
- per completion: `fn(prompt, completion, fields) -> float`; `prompt` is the problem's question
  text, `completion` the decoded completion (special tokens such as `<answer>` kept, pad/EOS
  removed: `decode.py`), `fields` the row's columns plus `question` and `answer`;
- batched, TRL's form: `fn(prompts=[...], completions=[...], **columns) -> list[float | None]`,
  once per batch, each column a list with one value per completion. Detected from the signature
  (a parameter named `completions` or `prompts`) or declared (`batched: true`). `None` is no
  reward for that completion: a completion no function gave a number is left out of its group's
  advantages (`reward/excluded`).

An `async def` function is awaited, every call of a batch concurrently. The weighted sum of the
functions is the completion's reward. An exception, or a value that is not a finite number,
gives that completion 0 from that function, is counted in the metrics rows as
`reward/errors/<function>` (a file's function as `file.py:function`) and logged once per
function with where it was raised (or what it returned); past `task.reward_max_error_share` of a
step's calls the run stops (`ftis.rewards.runtime.RewardFailure`).

This module imports no model code: configs validate functions by importing them only.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

RewardFn = Callable[[str, str, Mapping[str, Any]], Any]

BUILTIN_PREFIX = "builtin:"

# name -> function, or "module:attr" imported on first use. The built-in tasks' rewards live here.
REWARDS: dict[str, RewardFn | str] = {
    "builtin:exact_match": "ftis.rewards.builtin:exact_match",
    "builtin:reasoning": "ftis.rewards.builtin:reasoning",
    "builtin:gsm8k": "ftis.rewards.builtin:gsm8k",
    "builtin:gsm8k_format": "ftis.rewards.builtin:gsm8k_format",
    "builtin:gsm8k_answer": "ftis.rewards.builtin:gsm8k_answer",
}


class RewardError(ValueError):
    """A reward function cannot be found, or cannot be called in its form (per completion:
    `fn(prompt, completion, fields)`; batched: `fn(prompts=, completions=, **columns)`)."""


BATCHED_PARAMETERS = ("prompts", "completions")  # TRL's names: a function naming one is batched
# What a batched function's **columns never holds: the names TRL passes itself (or leaves out)
NOT_COLUMNS = frozenset({"prompt", "completion", "prompts", "completions", "completion_ids"})


def register_reward(name: str, fn: RewardFn | str) -> None:
    """Make `name` usable in `reward:` (replacing an earlier registration); `fn` may be a
    "module:attr" string, imported on first use. A plugin module ($FTIS_PLUGINS) may call it."""
    if ":" not in name:
        raise ValueError(f"reward name {name!r} needs a prefix, e.g. 'mine:{name}'")
    REWARDS[name] = fn
    _cache.pop(name, None)


_cache: dict[str, RewardFn] = {}


def _import_file(path: Path) -> Any:
    """Import a .py file as a module of its own (cached by absolute path)."""
    tag = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"ftis_reward_{path.stem}_{tag}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RewardError(f"cannot import {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def frame_of(exc: BaseException, prefer_file: str | None = None) -> traceback.FrameSummary | None:
    """The frame of `exc`'s traceback to show a user: the deepest one in `prefer_file` (the
    reward function's own file) when there is one, else the innermost."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    if prefer_file is not None:
        own = [f for f in frames if f.filename == prefer_file]
        if own:
            return own[-1]
    return frames[-1]


def _module_not_found(e: BaseException, module_name: str) -> bool:
    """Whether `e` says `module_name` itself (or a package above it) is not found, rather than
    a module it imports."""
    if not isinstance(e, ModuleNotFoundError) or e.name is None:
        return False
    return module_name == e.name or module_name.startswith(e.name + ".")


def _import_error(name: str, module_name: str, e: BaseException, path: Path | None) -> RewardError:
    """What went wrong importing the module of reward `name`, with where."""
    if isinstance(e, SyntaxError):
        where = f"{e.filename}:{e.lineno}" if e.filename else module_name
        return RewardError(
            f"reward {name!r}: {module_name!r} has a syntax error at {where}: {e.msg}"
            + (f" ({e.text.strip()!r})" if e.text and e.text.strip() else "")
        )
    if path is None and _module_not_found(e, module_name):
        return RewardError(
            f"reward {name!r}: cannot import {module_name!r} ({type(e).__name__}: {e}); put "
            "the module on PYTHONPATH, or name its file: path/to/file.py:function"
        )
    origin = str(path) if path is not None else _origin(module_name)
    frame = frame_of(e, origin)
    where = f" at {frame.filename}:{frame.lineno}" if frame is not None else ""
    return RewardError(
        f"reward {name!r}: importing {module_name!r} raised {type(e).__name__}: {e}{where}"
    )


def _origin(module_name: str) -> str | None:
    """The file `module_name` would be imported from (None when it cannot be found)."""
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    return None if spec is None else spec.origin


def split_name(name: str) -> tuple[str, str]:
    """("module or file", "function") of `module:function` / `file.py:function`."""
    module, sep, attr = name.rpartition(":")
    if not sep or not module or not attr:
        raise RewardError(
            f"reward {name!r} is not 'module:function', 'path/to/file.py:function' or a "
            f"registered name ({', '.join(sorted(REWARDS))})"
        )
    return module, attr


def short_name(name: str) -> str:
    """The name of a reward function in rows and logs: `file.py:function` for a file (no
    directories), the configured name otherwise."""
    module, _, attr = name.rpartition(":")
    if module.endswith(".py") or "/" in module:
        return f"{Path(module).name}:{attr}"
    return name


def is_batched(fn: Any) -> bool:
    """Whether `fn` takes TRL's batched form: a parameter named `completions` or `prompts`."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return any(n in params and params[n].kind not in kinds for n in BATCHED_PARAMETERS)


def check_signature(name: str, fn: Any, *, batched: bool) -> None:
    """RewardError when `fn` cannot be called in its form (no signature, a builtin: not
    checked)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature (a builtin): try it at run time
        return
    shown = f"{name.rpartition(':')[2]}{sig}"
    if not batched:
        try:
            sig.bind("prompt", "completion", {})
        except TypeError:
            raise RewardError(
                f"reward {name!r} cannot be called as fn(prompt, completion, fields): its "
                f"signature is {shown} (a batched function in TRL's form names its parameters "
                "prompts and completions, or is declared with batched: true)"
            ) from None
        return
    params = sig.parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "completions" not in params and not var_kw:
        raise RewardError(
            f"reward {name!r} is batched but has neither a `completions` parameter nor "
            f"**kwargs: its signature is {shown}; write it as fn(prompts, completions, **kwargs)"
        )
    positional_only = [
        p.name
        for p in params.values()
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is inspect.Parameter.empty
    ]
    if positional_only:
        raise RewardError(
            f"reward {name!r} is batched: it is called with keyword arguments (prompts=, "
            f"completions=, and the row's columns), but {positional_only} are positional-only "
            f"in {shown}"
        )


def resolve_reward(name: str, *, batched: bool | None = None) -> RewardFn:
    """The callable `name` designates, checked for its form (`batched`: None = detected from
    the signature, `is_batched`); RewardError saying what is wrong and how to fix it."""
    if name in _cache:
        fn = _cache[name]
    else:
        fn = _lookup(name)
    check_signature(name, fn, batched=is_batched(fn) if batched is None else batched)
    _cache[name] = fn
    return fn


_MISSING = object()


def _lookup(name: str) -> RewardFn:
    if name in REWARDS:
        target = REWARDS[name]
        if isinstance(target, str):
            module, attr = split_name(target)
            fn = getattr(importlib.import_module(module), attr)
        else:
            fn = target
    else:
        if name.startswith(BUILTIN_PREFIX):
            raise RewardError(
                f"no built-in reward {name!r}; built-in: "
                f"{', '.join(n for n in sorted(REWARDS) if n.startswith(BUILTIN_PREFIX))}"
            )
        module_name, attr = split_name(name)
        path = None
        try:
            if module_name.endswith(".py") or "/" in module_name:
                path = Path(module_name).expanduser().resolve()
                if not path.is_file():
                    raise RewardError(
                        f"reward {name!r}: no file {str(path)!r} (paths are relative to the "
                        "working directory)"
                    )
                module = _import_file(path)
            else:
                module = importlib.import_module(module_name)
        except RewardError:
            raise
        except Exception as e:
            raise _import_error(name, module_name, e, path) from None
        fn = getattr(module, attr, _MISSING)
        if fn is _MISSING:
            public = sorted(n for n, v in vars(module).items() if callable(v) and n[0] != "_")
            raise RewardError(
                f"reward {name!r}: {module_name!r} has no {attr!r}; its functions: {public}"
            )
    if not callable(fn):
        raise RewardError(
            f"reward {name!r}: {name.rpartition(':')[2]!r} exists but is a {type(fn).__name__} "
            f"({fn!r:.40}), not a function; name a function (def or async def)"
        )
    return fn


NO_CODE = {"import_code": False}  # a validation context: check a config without importing its code


def imports_code(info: ValidationInfo) -> bool:
    """Whether this validation imports the functions and environments a config names: not under
    the context NO_CODE (`ftis export` reads a run's config without the reward's module)."""
    return not (isinstance(info.context, dict) and info.context.get("import_code") is False)


class RewardTerm(BaseModel):
    """One function of a reward and its weight."""

    model_config = ConfigDict(extra="forbid")
    function: str = Field(
        description="'module:function', 'path/to/file.py:function' or a registered name such "
        "as 'builtin:gsm8k'; called as fn(prompt, completion, fields) -> float, or in TRL's "
        "batched form fn(prompts, completions, **columns) -> list[float | None] (or async)."
    )
    weight: float = Field(1.0, allow_inf_nan=False, description="Weight in the sum.")
    batched: bool | None = Field(
        None,
        description="true: TRL's batched form, fn(prompts=, completions=, **columns) -> "
        "list[float | None]; false: fn(prompt, completion, fields) -> float; null: detected "
        "(a parameter named completions or prompts is the batched form).",
    )

    @field_validator("function")
    @classmethod
    def _importable(cls, v: str, info: ValidationInfo) -> str:
        v = v.strip()
        if not imports_code(info):
            return v
        try:
            if v not in _cache:
                _cache[v] = _lookup(v)
        except RewardError as e:
            raise ValueError(str(e)) from None
        module, attr = v.rpartition(":")[0], v.rpartition(":")[2]
        if v not in REWARDS and (module.endswith(".py") or "/" in module):
            # a file is found from the working directory: keep it absolute, so worker processes
            # and resumed runs find it from anywhere
            v = f"{Path(module).expanduser().resolve()}:{attr}"
        return v

    @model_validator(mode="after")
    def _callable_in_its_form(self, info: ValidationInfo) -> RewardTerm:
        if not imports_code(info):
            return self
        try:
            resolve_reward(self.function, batched=self.batched)
        except RewardError as e:
            raise ValueError(str(e)) from None
        return self

    @property
    def is_batched(self) -> bool:
        """Whether the function is called in TRL's batched form."""
        if self.batched is not None:
            return self.batched
        return is_batched(resolve_reward(self.function))


def normalise_reward_spec(value: Any) -> Any:
    """The `reward:` shorthands as a list of {function, weight}: a string, a list of strings or
    mappings, or a mapping {function: weight}."""
    if value is None or (isinstance(value, list) and not value):
        return None
    if isinstance(value, str):
        return [{"function": value}]
    if isinstance(value, Mapping):
        if "function" in value:
            return [dict(value)]
        return [{"function": k, "weight": w} for k, w in value.items()]
    if isinstance(value, list | tuple):
        return [{"function": v} if isinstance(v, str) else v for v in value]
    return value


RewardSpec = list[RewardTerm]


def describe(value: Any) -> str:
    """What a reward returned, for a message: `None`, `str '1.0'`, `float nan`."""
    if value is None:
        return "None"
    text = repr(value)
    if len(text) > 40:
        text = text[:39] + "\u2026"
    return f"{type(value).__name__} {text}"


def finite_number(value: Any) -> float:
    """`value` as a float; TypeError/ValueError ("returned ...") when it is not a finite
    number."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, str | bytes) or (
        not isinstance(value, int | float) and not hasattr(value, "__float__")
    ):
        raise TypeError(f"returned {describe(value)}, not a number")
    try:
        out = float(value)
    except (TypeError, ValueError):  # an array of several values, say
        raise TypeError(f"returned {describe(value)}, not a number") from None
    if not math.isfinite(out):
        raise ValueError(f"returned {describe(value)}, not a finite number")
    return out


__all__ = [
    "REWARDS",
    "RewardError",
    "RewardFn",
    "RewardSpec",
    "RewardTerm",
    "check_signature",
    "describe",
    "finite_number",
    "is_batched",
    "normalise_reward_spec",
    "register_reward",
    "resolve_reward",
    "short_name",
]
