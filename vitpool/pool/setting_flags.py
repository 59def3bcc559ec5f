"""Each pool setting's command-line flag: `vitpool serve`'s flags and those of the vLLM gateway's
pool, one per `PoolSettings` field, its help from the field's docstring entry, its value parsed by
the field's type, so that a new setting needs no hand-written flag; and the parsers of the values
a type cannot describe (budgets, MIN,MAX, NAME=N pairs, on/off)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import types
import typing
from collections.abc import Callable, Collection, Sequence
from typing import Any

from vitpool.encoder_spec import (
    ATTENTION_CHOICES,
    DTYPE_CHOICES,
    PRECISION_CHOICES,
    EncoderSpec,
    check_budgets,
)
from vitpool.errors import ConfigError
from vitpool.pool.settings import (
    POOL_DEVICES,
    RANK_TRANSPORTS,
    REMOVED_SETTINGS,
    PoolSettings,
    removed_setting,
    setting_flag,
)


def budget_list(text: str) -> list[int]:
    """`--budgets`: comma-separated token budgets, checked by the pool's own rule
    (`vitpool.encoder_spec.check_budgets`: each at most MAX_BUDGET_TOKENS) before anything starts (an
    actor allocates every budget's buffers as it starts).

    Raises:
        argparse.ArgumentTypeError: which budget is wrong and why (argparse names --budgets).
    """
    budgets = []
    for part in text.split(","):
        try:
            budgets.append(int(part))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} is not a whole number; give output-token budgets such as 64,256,1024"
            ) from None
    try:
        check_budgets(budgets, None, in_pool=True)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return budgets


def autoscale_bounds(text: str) -> tuple[int, int]:
    """`--autoscale`: MIN,MAX actors (the pool checks the bounds themselves)."""
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use MIN,MAX, e.g. 1,4") from None
    return low, high


def capacity_limit_list(text: str) -> dict[str, int]:
    """`--capacity-limits`: NAME=N pairs, comma-separated, e.g. windows=64 (the model's capacities
    are checked by its actors)."""
    limits = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        try:
            limits[name.strip()] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part.strip()!r}: use NAME=N pairs, e.g. windows=64") from None
    return limits


def on_off(text: str) -> bool:
    """A True/False setting's flag value: on or off."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"{text!r}: use on or off")
    return text == "on"


# A setting's flag is its name with dashes, but a number of seconds drops its `_s`
# (autoscale_interval_s: --autoscale-interval S); its help is the field's entry in the settings'
# docstrings (PoolSettings, EncoderSpec, EncoderOptions); its value is parsed by the field's type:
# on/off for True/False, a number, a string, and "none" (NONE_GIVEN) for None where None is not
# the default. A flag left out is None in the parsed arguments, and the pool's own default stands.
# What the types cannot say:
SETTING_CHOICES: dict[str, tuple[str, ...]] = {
    "device": POOL_DEVICES,
    "dtype": DTYPE_CHOICES,
    "attention": ATTENTION_CHOICES,
    "precision": PRECISION_CHOICES,
    "rank_transport": RANK_TRANSPORTS,
}
SETTING_PARSERS: dict[str, tuple[Callable[[str], Any], str]] = {  # values of several parts: (parser, metavar)
    "budgets": (budget_list, "B,B,..."),
    "autoscale": (autoscale_bounds, "MIN,MAX"),
    "capacity_limits": (capacity_limit_list, "NAME=N,..."),
}
METAVARS = {"_s": "S", "_bytes": "BYTES", "_tokens": "TOKENS"}  # by the name's unit; else N or X
SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z(\"'`])")


def setting_docs(settings_class: type = PoolSettings) -> dict[str, list[str]]:
    """Each field's entries in the `Attributes:` sections of the class's docstring and its
    bases', base first (an entry "a, b: text" documents both)."""
    docs: dict[str, list[str]] = {}
    for klass in reversed(settings_class.__mro__):
        _, _, section = inspect.cleandoc(vars(klass).get("__doc__") or "").partition("\nAttributes:\n")
        names: list[str] = []
        for line in section.splitlines():
            if line and not line.startswith("    "):
                break  # the next section
            if line.startswith("        "):  # an entry's next line
                for name in names:
                    docs[name][-1] += " " + line.strip()
            elif line.strip():
                listed, _, text = line.strip().partition(": ")
                names = [name.strip() for name in listed.split(",")]
                for name in names:
                    docs.setdefault(name, []).append(text)
    return docs


def setting_help(field: dataclasses.Field, entries: Sequence[str], optional: bool) -> str:
    """A flag's help: the first sentence of each docstring entry, then its default where that
    sentence does not say it (for a default of None or empty: what that means, where the entry
    says)."""
    sentences = [SENTENCE_END.split(entry) for entry in entries]
    text = " ".join(each[0].rstrip(".") + "." for each in sentences)
    text = text[:1] + re.sub(
        r"\. ([a-z])", lambda match: ". " + match[1].upper(), text[1:]
    )  # entries start lowercase
    said = [s.partition(": ")[2] for each in sentences for s in each if re.match(r"(None|Empty)\b.*?: ", s)]
    unset = said[0].rstrip(".") if said else ""
    if field.default in (None, ()):
        default = "" if "None" in text or "default" in text else f"(default: {unset or 'None'})"
    elif "default" in text:
        default = f"(none: {unset or 'None'})" if optional else ""
    else:
        shown = ("on" if field.default else "off") if isinstance(field.default, bool) else field.default
        default = f"(default: {shown}; none: {unset or 'None'})" if optional else f"(default: {shown})"
    return f"{text} {default}".strip().replace("%", "%%")


def add_pool_setting_flags(
    parser: argparse.ArgumentParser, leave_out: Collection[str] = (), of: str = ""
) -> None:
    """A flag for every PoolSettings field but those in `leave_out`, in two groups: the encoder's
    options and the pool's own settings (`of`: added to the groups' titles, what the settings
    are for); and a hidden one for each of REMOVED_SETTINGS, refused naming its replacement. Read
    what was given with `given_settings`.

    Raises:
        TypeError: a field of a type no flag parses (a new one goes in SETTING_PARSERS).
    """
    docs = setting_docs()
    hints = typing.get_type_hints(PoolSettings)
    encoder_fields = {field.name for field in dataclasses.fields(EncoderSpec)}
    groups = {
        True: parser.add_argument_group(f"the encoder's options (vitpool.encoder_spec.EncoderOptions){of}"),
        False: parser.add_argument_group(f"the pool's settings (vitpool.PoolSettings){of}"),
    }
    for field in dataclasses.fields(PoolSettings):
        if field.name in leave_out:
            continue
        hint = hints[field.name]
        parts = [part for part in typing.get_args(hint) if part is not type(None)]
        optional = typing.get_origin(hint) in (types.UnionType, typing.Union) and len(parts) == 1
        kind = parts[0] if optional else hint
        flag: dict[str, Any] = {
            "dest": field.name,
            "default": None,
            "help": setting_help(field, docs.get(field.name, []), optional),
        }
        if field.name in SETTING_PARSERS:
            flag["type"], flag["metavar"] = SETTING_PARSERS[field.name]
        elif field.name in SETTING_CHOICES:
            flag["choices"] = SETTING_CHOICES[field.name]
        elif kind is bool:
            flag["type"], flag["metavar"] = on_off, "{on,off}"
        elif kind in (int, float, str):
            unit = next(
                (metavar for suffix, metavar in METAVARS.items() if field.name.endswith(suffix)), None
            )
            flag["metavar"] = unit or {int: "N", float: "X", str: field.name.upper()}[kind]
            flag["type"] = _or_none(kind) if optional and field.default is not None else kind
        else:
            raise TypeError(
                f"PoolSettings.{field.name} ({hint}): no flag parses it; add it to SETTING_PARSERS"
            )
        groups[field.name in encoder_fields].add_argument(setting_flag(field.name), **flag)
    for name in REMOVED_SETTINGS:  # hidden: naming one is an error that names its replacement
        parser.add_argument(
            setting_flag(name), nargs="?", action=_Removed, dest=f"removed_{name}", help=argparse.SUPPRESS
        )


class _Removed(argparse.Action):
    """A removed setting's flag (REMOVED_SETTINGS): refused, naming what replaced it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option: Any = None):
        parser.error(removed_setting(self.dest.removeprefix("removed_"), flag=True))


class _NoneGiven:
    """A flag's value "none": the setting set to None, where a flag left out is None too."""

    def __repr__(self) -> str:
        return "none"


NONE_GIVEN = _NoneGiven()


def _or_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, but "none" is NONE_GIVEN."""

    def parse_or_none(text: str) -> Any:
        return NONE_GIVEN if text == "none" else parse(text)

    parse_or_none.__name__ = parse.__name__  # argparse names it in its error: "invalid int value"
    return parse_or_none


def given_settings(args: argparse.Namespace, leave_out: Collection[str] = ()) -> dict[str, Any]:
    """The pool settings that flags of `add_pool_setting_flags` (given the same `leave_out`) set, by
    field name: those given (a flag left out is None, and the pool's own default stands; "none"
    sets None)."""
    given = {
        field.name: getattr(args, field.name, None)
        for field in dataclasses.fields(PoolSettings)
        if field.name not in leave_out
    }
    return {
        name: None if value is NONE_GIVEN else value for name, value in given.items() if value is not None
    }
