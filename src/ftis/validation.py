"""Validation errors a user can act on: one line per problem, with the field's dotted path and,
for an unknown field, the closest valid one (`ftis.config` and every registered config class
use it). Imports nothing of ftis: the run config registers itself in MODELS (by its title), so
that an error raised while validating it can name the valid fields."""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

# pydantic model title -> model, for the suggestions of format_validation_error when a caller
# gives no model (ftis.config registers RunConfig).
MODELS: dict[str, type[BaseModel]] = {}


def format_validation_error(
    err: ValidationError,
    *,
    header: str = "invalid config:\n",
    indent: str = "  ",
    sep="\n",
    model: type[BaseModel] | None = None,
    prefix: str = "",
) -> str:
    """One line per problem: `  field.path: what is wrong (got value)`. An unknown field says
    which valid field of `model` (default: the model that failed) it is closest to;
    `prefix` is the dotted path of `model` inside the run config, for those suggestions."""
    lines = []
    model = model or _model_named(err.title)
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-"))
        if e["type"] == "extra_forbidden":
            lines.append(f"{indent}{_unknown_field(model, e['loc'], prefix)}")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        got = e.get("input")
        got_txt = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
        lines.append(f"{indent}{loc or '<top level>'}: {msg}{got_txt}")
    return header + sep.join(lines)


def _model_named(title: str) -> type[BaseModel] | None:
    return MODELS.get(title)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (through Optional, list, dict, unions)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _kind_of(model: type[BaseModel]) -> Any:
    field = model.model_fields.get("kind")
    return None if field is None else field.default


def _unknown_field(model: type[BaseModel] | None, loc: tuple, prefix: str) -> str:
    """`unknown field 'train.step': did you mean train.steps?`, from the fields valid where the
    unknown one stands (difflib's closest match), or the list of them when none is close."""
    parts = [p for p in loc if not str(p).startswith("function-")]
    models = [model] if model is not None else []
    shown = list(parts)
    for part in parts[:-1]:
        if isinstance(part, int) or str(part).isdigit():
            continue
        if not any(part in m.model_fields for m in models):  # a tagged union's tag (task kind)
            models = [m for m in models if _kind_of(m) == part]
            shown.remove(part)
            continue
        models = [
            sub
            for m in models
            if part in m.model_fields
            for sub in _models_in(m.model_fields[part].annotation)
        ]
    dotted = prefix + ".".join(str(p) for p in shown)
    names = sorted({n for m in models for n in m.model_fields})
    if not names:
        return f"unknown field {dotted!r}"
    where = dotted.rsplit(".", 1)[0] + "." if "." in dotted else ""
    close = difflib.get_close_matches(str(parts[-1]), names, n=1, cutoff=0.6)
    if close:
        return f"unknown field {dotted!r}: did you mean {where}{close[0]}?"
    return f"unknown field {dotted!r}; valid fields here: {', '.join(names)}"


def validate_section(
    model: type[BaseModel], value: dict[str, Any], prefix: str, *, context: Any = None
) -> Any:
    """`value` validated as `model`, a registered kind's config (a run's `task.` or
    `algorithm.` section, `prefix`), under the validation `context`: ValueError listing its
    problems on one line."""
    try:
        return model.model_validate(value, context=context)
    except ValidationError as e:
        raise ValueError(
            format_validation_error(e, header="", indent="", sep="; ", model=model, prefix=prefix)
        ) from None
