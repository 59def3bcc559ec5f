"""`vitpool serve`'s flags: one per `PoolSettings` field (made in `vitpool.pool.setting_flags`, where the
vLLM gateway's pool gets the same flags, `add_pool_setting_flags`), but those `serve` has no flag
for; and the flags of the actors' shares, which are no setting."""

from __future__ import annotations

import argparse
import math

from vitpool.pool.setting_flags import (  # noqa: F401 - the flags' parts, read from here too
    NONE_GIVEN,
    SETTING_CHOICES,
    SETTING_PARSERS,
    add_pool_setting_flags,
    autoscale_bounds,
    budget_list,
    capacity_limit_list,
    given_settings,
    on_off,
)
from vitpool.pool.settings import setting_flag  # noqa: F401 - read from here too

NOT_SERVE_FLAGS = {  # settings `serve` has no flag for, and why
    "detached": "serve always starts a detached pool: one that outlives the command is what it is for",
}


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """`serve`'s flag for every PoolSettings field but NOT_SERVE_FLAGS (`add_pool_setting_flags`)."""
    add_pool_setting_flags(parser, leave_out=NOT_SERVE_FLAGS)


def non_negative_share(text: str) -> float:
    """`--cpus-per-actor`, `--gpus-per-actor`: a number >= 0 (a fraction shares one CPU or GPU)."""
    try:
        share = float(text)
    except ValueError:
        share = math.nan
    if not (math.isfinite(share) and share >= 0):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number >= 0, e.g. 0.5 or 2")
    return share
