"""What any order of runs can give small and medium calls under load: a simulation of one actor
serving `pool_throughput.py`'s mix at 70% of its saturated rate, per run-ordering policy.

The model (calibrated on the H100 figures of benchmarks/RESULTS.md, "Small calls under load"):
calls arrive as a Poisson stream; each call's items are packed by its caller into batches of at
most `MAX_RUN_TOKENS` (a small call's apart); the actor merges waiting batches into runs of at
most `MAX_RUN_TOKENS`; a run holds the GPU for `RUN_FIXED_S + tokens * TOKEN_S`; a call also
pays `CALL_FIXED_S + tokens * CALL_TOKEN_S` of host work outside the GPU's queue (caller,
transport, copies). With overlapping runs (the actor's default) the next run is chosen when the
run before it starts on the GPU, so a batch that arrives waits for the run in flight and the one
queued behind it. Segmented runs (not built) let a waiting small batch run between two segments
of a run, each segment `1 / segments` of it.

    python benchmarks/studies/small_call_tails.py [--load 0.7] [--seconds 600]

Slowdown is a call's latency over its size class's unloaded p50 (small <= 256 tokens < medium
<= 1024 < large), as in `pool_throughput.py`.

Seen (this machine, 2026-11-25, `--seconds 600`): the model puts small-first at small / medium /
large p99 6.5x / 7.9x / 4.5x (measured on the H100: 7.5x / 10.3x / 4.4x). Small calls reach 3x
only where a waiting small batch runs almost at once and apart from large ones (64 segments a
run: 2.9x; one a block, 27: 3.3x; 8: 4.0x); medium calls stay at 7.6-9.7x p99 under every order
tried, already 1.8x at no load (the class spans 257-1024 tokens), and they are 76% of the mix's
work, so they queue behind one another whatever goes first.

Floors no order can beat (printed first; M/D/1: every call of a class taking its class's p50,
which only narrows the tails): at 70% load, medium calls served behind small ones only (load 61%)
have p99 >= 5.73x, and served ahead of small ones they make small calls' p99 >= 7.80x, so the
issue's "small <= 3x and every class <= 5x" cannot both hold on one actor at 70%. At 50% the
floors are 3.83x and 5.52x: small-first with small batches between segments of about a block
fits (model: small 2.63x, medium 5.12x, large 2.97x with 27 segments). Several actors narrow the
floor at equal load: all calls' p99 >= 4.08x on 2 actors and 2.46x on 4 at 70% (M/D/c).
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from dataclasses import dataclass, field

IMAGE_SIDES = (224, 320, 448, 512, 640, 768, 896, 1024)
VIDEO_SIDES = (224, 320, 448)
VIDEO_SHARE = 0.15
PIXELS_PER_TOKEN_SIDE = 32  # Qwen3-VL: 16-pixel patches, 2 x 2 merged
MAX_RUN_TOKENS = 1024
SMALL_TOKENS = 256

# Calibration (one H100, the real-size Qwen3-VL-8B tower): a saturated actor serves 176.8 items/s
# of the mix (365.9 tokens an item) in runs of about MAX_RUN_TOKENS; unloaded, a small call's p50
# is 5.8 ms (its median 196 tokens), a medium call's 14.3 ms (512), a large one's 31 ms (1216).
SATURATED_ITEMS_PER_S = 176.8
ITEMS_PER_CALL = 1.28155  # the mix's mean: 15% one video, else one or two images
TOKENS_PER_ITEM = 365.9
RUN_FIXED_S = 0.0015
TOKEN_S = (1 / (SATURATED_ITEMS_PER_S * TOKENS_PER_ITEM)) * (
    1 - RUN_FIXED_S * SATURATED_ITEMS_PER_S * TOKENS_PER_ITEM / MAX_RUN_TOKENS
)
CALL_FIXED_S = 0.0012
CALL_TOKEN_S = 0.000006


def size_class(tokens: int) -> str:
    return "small" if tokens <= SMALL_TOKENS else "medium" if tokens <= MAX_RUN_TOKENS else "large"


def random_call(rng: random.Random) -> list[int]:
    """Output tokens of each item of one call of the benchmark's mix."""
    if rng.random() < VIDEO_SHARE:
        side = rng.choice(VIDEO_SIDES) // PIXELS_PER_TOKEN_SIDE
        return [4 * side * side]
    return [
        (rng.choice(IMAGE_SIDES) // PIXELS_PER_TOKEN_SIDE)
        * (rng.choice(IMAGE_SIDES) // PIXELS_PER_TOKEN_SIDE)
        for _ in range(rng.choice((1, 1, 2)))
    ]


def caller_batches(items: list[int]) -> list[int]:
    """The call's batches as its caller packs them: items in order, a new batch when one is full."""
    batches = [0]
    for tokens in items:
        if batches[-1] and batches[-1] + tokens > MAX_RUN_TOKENS:
            batches.append(0)
        batches[-1] += tokens
    return batches


@dataclass
class Call:
    arrival: float
    tokens: int
    left: int  # batches not yet done
    done_at: float = 0.0  # when its last batch's run ended

    @property
    def host_s(self) -> float:
        return CALL_FIXED_S + CALL_TOKEN_S * self.tokens


@dataclass(order=True)
class Batch:
    arrival: float
    number: int
    tokens: int = field(compare=False)
    call: Call = field(compare=False)
    passes: int = field(default=0, compare=False)

    @property
    def small(self) -> bool:
        return self.call.tokens <= SMALL_TOKENS


@dataclass(frozen=True)
class Policy:
    name: str
    order: str  # "oldest": oldest first; "small": small calls' batches first; "shortest": shortest call first
    overlap: bool = True  # next run chosen when the one before starts (True) or ends (False)
    segments: int = 1  # a run's preemption points for small batches: segments - 1
    max_passes: int = 4
    gap_s: float = 0.0  # GPU idle between runs where the next is chosen only when one ends
    small_alone: bool = False  # small batches never share a run with others


SMALL_LANE = Policy("small batches between segments", "oldest")


def take_group(waiting: list[Batch], policy: Policy) -> list[Batch]:
    """The next run's batches (as `vitpool.actors.combining`): the chosen batch first, then others
    in order as far as they fit."""
    starving = any(b.passes >= policy.max_passes for b in waiting)
    if policy.order == "oldest" or starving:
        ranked = sorted(waiting)
    elif policy.order == "small":
        ranked = sorted(waiting, key=lambda b: (not b.small, b.arrival, b.number))
    else:
        ranked = sorted(waiting, key=lambda b: (b.call.tokens, b.arrival, b.number))
    group, tokens = [ranked[0]], ranked[0].tokens
    for candidate in ranked[1:]:
        if policy.small_alone and candidate.small != ranked[0].small:
            continue  # small batches run apart from the others
        if tokens + candidate.tokens <= MAX_RUN_TOKENS:
            group.append(candidate)
            tokens += candidate.tokens
    last = max(b.arrival for b in group)
    for b in waiting:
        if b not in group and b.arrival < last:
            b.passes += 1
    return group


def simulate(policy: Policy, load: float, seconds: float, seed: int) -> dict[str, list[float]]:
    """Per size class, each call's latency (s), calls of the first 5% left out (warm-up)."""
    rng = random.Random(seed)
    calls_per_s = load * SATURATED_ITEMS_PER_S / ITEMS_PER_CALL
    calls: list[Call] = []
    future: list[Batch] = []  # batches not yet at the actor, by arrival
    t, number = 0.0, 0
    while t < seconds:
        t += rng.expovariate(calls_per_s)
        items = random_call(rng)
        batches = caller_batches(items)
        call = Call(t, sum(items), len(batches))
        calls.append(call)
        for tokens in batches:  # half the call's host work before the actor, half after
            number += 1
            future.append(Batch(t + call.host_s / 2, number, tokens, call))
    future.reverse()  # pop() gives the earliest
    waiting: list[Batch] = []

    def admit(until: float) -> None:
        while future and future[-1].arrival <= until:
            waiting.append(future.pop())

    def take(pick_from: list[Batch], order: Policy) -> list[Batch]:
        group = take_group(pick_from, order)
        for b in group:
            waiting.remove(b)
        return group

    def finish(group: list[Batch], at: float) -> None:
        for b in group:
            b.call.left -= 1
            b.call.done_at = max(b.call.done_at, at)

    gpu_free = 0.0
    queued: list[Batch] | None = None  # with overlap: the run chosen while the one before ran
    decision = 0.0
    while future or waiting or queued:
        if queued is not None:
            group, begin = queued, gpu_free
        else:
            admit(decision)
            if not waiting:
                decision = future[-1].arrival
                admit(decision)
            group = take(waiting, policy)
            begin = max(decision, gpu_free) + (0.0 if policy.overlap else policy.gap_s)
        queued = None
        if policy.overlap:  # the leader chooses the next run as this one starts
            admit(begin)
            queued = take(waiting, policy) if waiting else None
        duration = run_time(group)
        segment = duration / policy.segments
        now = begin
        for index in range(policy.segments):
            now += segment
            if index == policy.segments - 1 or all(b.small for b in group):
                continue
            # a small batch that waited when the segment before this one was queued runs here
            admit(now - segment)
            small = [b for b in waiting if b.small]
            if small:
                extra = take(small, SMALL_LANE)
                now += run_time(extra)
                finish(extra, now)
        finish(group, now)
        gpu_free = now
        decision = now
    latencies: dict[str, list[float]] = {"small": [], "medium": [], "large": []}
    for call in calls:
        if call.arrival > seconds * 0.05:
            latencies[size_class(call.tokens)].append(call.done_at + call.host_s / 2 - call.arrival)
    return latencies


def run_time(group: list[Batch]) -> float:
    return RUN_FIXED_S + TOKEN_S * sum(b.tokens for b in group)


def unloaded_p50(seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    alone: dict[str, list[float]] = {"small": [], "medium": [], "large": []}
    for _ in range(20000):
        items = random_call(rng)
        call = Call(0.0, sum(items), 0)
        gpu = sum(RUN_FIXED_S + TOKEN_S * b for b in caller_batches(items))
        alone[size_class(call.tokens)].append(call.host_s + gpu)
    return {name: statistics.median(values) for name, values in alone.items()}


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def fixed_service_p99(load: float, calls: int, seed: int, servers: int = 1) -> float:
    """p99 latency, in service times, of `servers` servers fed Poisson arrivals at `load` each when
    every call takes the same time (M/D/c, first come first served): no order does better for
    calls of one size, and spread sizes only widen the tail. A floor for any class's p99 slowdown
    at that load."""
    rng = random.Random(seed)
    arrival = 0.0
    free = [0.0] * servers  # when each server is next free, a heap
    latencies = []
    for _ in range(calls):
        arrival += rng.expovariate(load * servers)
        done = max(arrival, heapq.heappop(free)) + 1.0
        heapq.heappush(free, done)
        latencies.append(done - arrival)
    return percentile(latencies, 0.99)


def work_shares(seed: int) -> dict[str, float]:
    """Each size class's share of the mix's GPU work."""
    rng = random.Random(seed)
    work = {"small": 0.0, "medium": 0.0, "large": 0.0}
    for _ in range(20000):
        items = random_call(rng)
        work[size_class(sum(items))] += sum(RUN_FIXED_S + TOKEN_S * b for b in caller_batches(items))
    total = sum(work.values())
    return {name: value / total for name, value in work.items()}


POLICIES = (
    Policy("oldest first, overlap (old default)", "oldest"),
    Policy("small first, overlap (the default)", "small"),
    Policy("small first, no overlap (3 ms GPU gap a run)", "small", overlap=False, gap_s=0.003),
    Policy("small first, no overlap, no gap (ideal host)", "small", overlap=False),
    Policy("shortest call first, overlap", "shortest"),
    Policy("small first, overlap, 4 segments", "small", segments=4),
    Policy("small first, overlap, 8 segments", "small", segments=8),
    Policy("shortest call first, overlap, 4 segments", "shortest", segments=4),
    Policy("small first, overlap, 64 segments (a small batch barely waits)", "small", segments=64),
    Policy("small first, small runs alone, overlap", "small", small_alone=True),
    Policy("small first, small runs alone, overlap, 4 segments", "small", segments=4, small_alone=True),
    Policy("small first, small runs alone, overlap, 8 segments", "small", segments=8, small_alone=True),
    Policy(
        "small first, small runs alone, overlap, 27 segments (one a block)",
        "small",
        segments=27,
        small_alone=True,
    ),
    Policy("small first, small runs alone, overlap, 64 segments", "small", segments=64, small_alone=True),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", type=float, default=0.7)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    base = unloaded_p50(args.seed)
    floor = simulate(Policy("alone", "oldest"), 0.001, args.seconds * 200, args.seed)
    print("unloaded p50 ms: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in base.items()))
    shares = work_shares(args.seed)
    print("share of the GPU's work: " + ", ".join(f"{k} {v:.0%}" for k, v in shares.items()))
    # Floors where every call of a class takes its p50 (M/D/1). Medium calls behind small ones only
    # see the load of both. Ahead of small ones, a small call arriving waits for the medium work
    # there (Poisson arrivals see the time average), whose p99 is the medium calls' own wait.
    medium_behind_small = fixed_service_p99(
        args.load * (shares["small"] + shares["medium"]), 400_000, args.seed
    )
    medium_alone = fixed_service_p99(args.load * shares["medium"], 400_000, args.seed)
    small_behind_medium = 1 + (medium_alone - 1) * base["medium"] / base["small"]
    print(
        f"floors (every call of a class its p50, M/D/1): "
        f"all calls {fixed_service_p99(args.load, 400_000, args.seed):.2f}x "
        f"p99 at load {args.load:.0%}; medium calls behind small ones only: p99 {medium_behind_small:.2f}x; "
        f"medium ahead of small: small p99 {small_behind_medium:.2f}x"
    )
    print(
        "floors of all calls (M/D/c) on 2 and 4 actors: "
        + ", ".join(
            f"{servers}: {fixed_service_p99(args.load, 400_000, args.seed, servers):.2f}x"
            for servers in (2, 4)
        )
    )
    print(f"| policy (load {args.load:.0%}) | small p50 / p99 slowdown | medium | large |")
    print("|---|---|---|---|")
    cells = [
        f"{percentile(floor[k], 0.5) / base[k]:.2f}x / {percentile(floor[k], 0.99) / base[k]:.2f}x"
        for k in base
    ]
    print("| no load (the mix's own spread) | " + " | ".join(cells) + " |")
    for policy in POLICIES:
        latencies = simulate(policy, args.load, args.seconds, args.seed)
        cells = [
            f"{percentile(latencies[k], 0.5) / base[k]:.2f}x / "
            f"{percentile(latencies[k], 0.99) / base[k]:.2f}x"
            for k in ("small", "medium", "large")
        ]
        print(f"| {policy.name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
