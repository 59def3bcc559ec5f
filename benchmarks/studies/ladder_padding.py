"""Padding of budget ladders on `pool_throughput.py`'s mix of calls, by simulation (no GPU): each
ladder packs the same calls with vitpool's packer, alone (a quiet pool: each call packed by
itself) and in queues of several calls (a loaded pool: the dispatcher packs what waits together).

    python benchmarks/studies/ladder_padding.py [--calls 2000] [--queue 8]

Padding is counted in rows (4 per token), over every batch that runs in a graph; an item above the
largest budget runs eager at its own rows and pads nothing. Prints, per ladder, the graphs it needs
(budgets and their few-sequence variants) and the padding share.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common.py etc. live one folder up

from pool_throughput import IMAGE_SIDES, PATCH, VIDEO_SHARE, VIDEO_SIDES

from vitpool.packing import SEQUENCES, ItemCost, budget_ladder, make_budgets, pack


def random_call_costs(rng: random.Random) -> list[ItemCost]:
    """The items of one call as the packer sees them (tokens, attention sequences), drawn as
    pool_throughput.py draws its calls."""
    if rng.random() < VIDEO_SHARE:
        side = rng.choice(VIDEO_SIDES) // PATCH
        return [ItemCost(4 * side * side // 4, ((SEQUENCES, 4),))]  # 4 temporal patches, one sequence each
    return [
        ItemCost(
            rng.choice(IMAGE_SIDES) // PATCH * (rng.choice(IMAGE_SIDES) // PATCH) // 4, ((SEQUENCES, 1),)
        )
        for _ in range(rng.choice((1, 1, 2)))
    ]


def fine_ladder(max_tokens: int) -> list[int]:
    """Steps of 32 tokens up to 256, then 12.5%."""
    return sorted({*range(64, 257, 32), *budget_ladder(256, max_tokens, 1.125, 32)})


LADDERS = {
    "64…4096, doubling to 256 (before issue 14)": lambda: budget_ladder(64, 4096, 1.125, 32),
    "64…1024, doubling to 256 (GRAPH_MAX_TOKENS)": lambda: budget_ladder(64, 1024, 1.125, 32),
    "64…1024, 32-token steps to 256": lambda: fine_ladder(1024),
    "64…1024, 32-token steps to 256, then 6.25%": lambda: sorted(
        {*range(64, 257, 32), *budget_ladder(256, 1024, 1.0625, 32)}
    ),
}


def padding(calls: list[list[ItemCost]], tokens: list[int], queue: int) -> tuple[int, float]:
    budgets = make_budgets(tokens, None, None)
    used = padded = 0
    for start in range(0, len(calls), queue):
        items = [item for call in calls[start : start + queue] for item in call]
        for batch in pack(items, budgets):
            if batch.budget is None:
                continue
            used += 4 * batch.num_tokens
            padded += 4 * (batch.budget.num_tokens - batch.num_tokens)
    return len(budgets), padded / (used + padded)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--queue", type=int, default=8, help="calls packed together under load")
    args = parser.parse_args()
    rng = random.Random(0)
    calls = [random_call_costs(rng) for _ in range(args.calls)]
    print(f"{args.calls} calls of pool_throughput.py's mix; padding share of graph rows")
    print(f"| ladder | graphs | each call alone | {args.queue} calls together |\n|---|---|---|---|")
    for name, ladder in LADDERS.items():
        tokens = ladder()
        graphs, alone = padding(calls, tokens, 1)
        _, together = padding(calls, tokens, args.queue)
        print(f"| {name} | {graphs} | {100 * alone:.1f}% | {100 * together:.1f}% |")


if __name__ == "__main__":
    main()
