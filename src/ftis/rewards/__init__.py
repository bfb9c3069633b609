"""Rewards: named functions of (prompt, completion, fields) -> float, combined with weights.

A reward is configured on the task (`task.reward`) or on one node (`nodes[i].reward`, which wins
for that node); without one a task uses its built-in reward (`default_reward` of its config).

    reward: my_rewards:exact                     # one function, weight 1
    reward: [my_rewards:exact, builtin:gsm8k_format]
    reward:
      - {function: my_rewards:exact, weight: 1.0}
      - {function: ./rewards.py:short, weight: 0.2}   # a file, relative to the working directory

A function is `module:function` (imported like $FTIS_PLUGINS: the module must be importable),
`path/to/file.py:function`, or a registered name (`builtin:gsm8k`, ..., `register_reward`). It is
called as `fn(prompt, completion, fields)`: `prompt` is the problem's question text, `completion`
the decoded completion (special tokens such as `<answer>` kept, pad/EOS removed: `decode.py`),
`fields` the row's columns plus `question` and `answer` (the task's gold answer). It returns a
number; an `async def` function is awaited, every completion of a batch concurrently. The
weighted sum of the functions is the completion's reward. An exception (or a value that is not a
finite number) gives that completion 0 from that function, is counted in the metrics rows as
`reward/errors/<function>` (a file's function as `file.py:function`) and logged once per function with where it was raised.

This module imports no model code: configs validate functions by importing them only.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
    """A reward function cannot be found or called as `fn(prompt, completion, fields)`."""


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


def resolve_reward(name: str) -> RewardFn:
    """The callable `name` designates; RewardError saying what is wrong and how to fix it."""
    if name in _cache:
        return _cache[name]
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
            raise RewardError(
                f"reward {name!r}: cannot import {module_name!r} ({type(e).__name__}: {e}); put "
                "the module on PYTHONPATH, or name its file: path/to/file.py:function"
            ) from None
        fn = getattr(module, attr, None)
        if fn is None:
            public = sorted(n for n, v in vars(module).items() if callable(v) and n[0] != "_")
            raise RewardError(
                f"reward {name!r}: {module_name!r} has no {attr!r}; its functions: {public}"
            )
    if not callable(fn):
        raise RewardError(f"reward {name!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind("prompt", "completion", {})
    except TypeError:
        raise RewardError(
            f"reward {name!r} cannot be called as fn(prompt, completion, fields): "
            f"its signature is {name.rpartition(':')[2]}{inspect.signature(fn)}"
        ) from None
    except ValueError:  # no signature (a builtin): try it at run time
        pass
    _cache[name] = fn
    return fn


class RewardTerm(BaseModel):
    """One function of a reward and its weight."""

    model_config = ConfigDict(extra="forbid")
    function: str = Field(
        description="'module:function', 'path/to/file.py:function' or a registered name such "
        "as 'builtin:gsm8k'; called as fn(prompt, completion, fields) -> float (or async)."
    )
    weight: float = Field(1.0, allow_inf_nan=False, description="Weight in the sum.")

    @field_validator("function")
    @classmethod
    def _importable(cls, v: str) -> str:
        v = v.strip()
        try:
            resolve_reward(v)
        except RewardError as e:
            raise ValueError(str(e)) from None
        module, attr = v.rpartition(":")[0], v.rpartition(":")[2]
        if v not in REWARDS and (module.endswith(".py") or "/" in module):
            # a file is found from the working directory: keep it absolute, so worker processes
            # and resumed runs find it from anywhere
            v = f"{Path(module).expanduser().resolve()}:{attr}"
        return v


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


def finite_number(value: Any) -> float:
    """`value` as a float; TypeError/ValueError when it is not a finite number."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, int | float) and not hasattr(value, "__float__"):
        raise TypeError(f"returned {type(value).__name__} {value!r:.40}, not a number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"returned {out}, not a finite number")
    return out


__all__ = [
    "REWARDS",
    "RewardError",
    "RewardFn",
    "RewardSpec",
    "RewardTerm",
    "finite_number",
    "normalise_reward_spec",
    "register_reward",
    "resolve_reward",
    "short_name",
]
