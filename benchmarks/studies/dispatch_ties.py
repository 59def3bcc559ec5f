"""A toy of the dispatcher's actor choice: do callers that each see only their own batches spread
over a large pool? C caller processes x K threads call back to back with calls of
`pool_throughput.py`'s mix; A actors, each a FIFO GPU serving 169 items/s of the mix (one H100);
each caller picks actors by `DispatchPolicy.choose_actor`'s rule on its own in-flight view (least
own outstanding cost, at most 2 batches per actor), ties broken by lowest index or by an order of
the caller's own. Transport time is ignored; one batch per item. A simulation only: no GPU, no Ray.

    python benchmarks/studies/dispatch_ties.py

Seen (this machine, 2026-11-25): 32 callers x 8 threads over 32 actors: lowest-index ties gave 14
actors work (1807 items/s of a GPU-bound 5408); an order per caller gave all 32 work.
"""

import heapq
import random

IMAGE_SIDES = (224, 320, 448, 512, 640, 768, 896, 1024)
VIDEO_SIDES = (224, 320, 448)
PATCH = 16

ITEMS_PER_S = 169  # one actor (one H100) on the benchmark's mix
RATE = ITEMS_PER_S * 401.9  # tokens/s of one actor
CASES = ((8, 8, 4), (32, 8, 32))  # (callers C, threads per caller K, actors A)


def random_call(rng):
    """One call of the mix: (is_video, (frames, rows, columns) in patches) per item."""
    if rng.random() < 0.15:
        side = rng.choice(VIDEO_SIDES) // PATCH
        shapes = [(True, (4, side, side))]
    else:
        shapes = [
            (False, (1, rng.choice(IMAGE_SIDES) // PATCH, rng.choice(IMAGE_SIDES) // PATCH))
            for _ in range(rng.choice((1, 1, 2)))
        ]
    rng.randrange(1 << 30)  # the seed pool_throughput.py draws for the call's pixels
    return shapes


def run(C, K, A, seconds=30.0, max_in_flight=2, own_order=False):
    """Simulate `seconds` of C callers x K threads over A actors: (items/s, actors given work,
    each actor's busy share)."""
    calls = [random_call(rng) for rng in [random.Random(seed) for seed in range(C)] for _ in range(24)]
    rng = random.Random(1)
    # each caller's tie-break order of the actors: by index, or a shuffle of its own
    rank = [
        [
            (hash((random.Random(100 + caller).getrandbits(32), actor)) if own_order else actor)
            for actor in range(A)
        ]
        for caller in range(C)
    ]
    cost = [[0.0] * A for _ in range(C)]  # each caller's outstanding tokens per actor
    in_flight = [[0] * A for _ in range(C)]  # each caller's batches in flight per actor
    free_at = [0.0] * A
    served = [0] * A
    busy = [0.0] * A
    queue = [[] for _ in range(C)]  # each caller's batches not yet sent: (tokens, call)
    events = []  # batches finishing: (time, sequence, caller, actor, tokens, call)
    items = 0
    sequence = 0

    def try_send(now, caller):
        nonlocal sequence
        while queue[caller]:
            candidates = [
                (cost[caller][actor], rank[caller][actor], actor)
                for actor in range(A)
                if in_flight[caller][actor] < max_in_flight
            ]
            if not candidates:
                return
            actor = min(candidates)[2]
            tokens, call = queue[caller].pop(0)
            cost[caller][actor] += tokens
            in_flight[caller][actor] += 1
            start = max(now, free_at[actor])
            free_at[actor] = start + tokens / RATE
            busy[actor] += tokens / RATE
            sequence += 1
            heapq.heappush(events, (free_at[actor], sequence, caller, actor, tokens, call))

    def new_call(now, caller):
        call = {"left": 0}
        for _, (frames, rows, columns) in calls[rng.randrange(len(calls))]:
            queue[caller].append((frames * rows * columns // 4, call))
            call["left"] += 1
        try_send(now, caller)

    for caller in range(C):
        for _ in range(K):
            new_call(0.0, caller)
    while events:
        now, _, caller, actor, tokens, call = heapq.heappop(events)
        if now > seconds:
            break
        cost[caller][actor] -= tokens
        in_flight[caller][actor] -= 1
        served[actor] += 1
        items += 1
        call["left"] -= 1
        if call["left"] == 0:
            new_call(now, caller)
        try_send(now, caller)
    used = sum(1 for count in served if count > 0)
    return items / seconds, used, [round(min(1, time / seconds), 2) for time in busy]


def main() -> None:
    for own in (False, True):
        for C, K, A in CASES:
            items_per_s, used, busy = run(C, K, A, own_order=own)
            print(
                f"own_order={own}: {C} callers x {K} threads, {A} actors: {items_per_s:.0f} items/s "
                f"(GPU-bound {A * ITEMS_PER_S}); actors given work {used}; "
                f">90% busy {sum(share > 0.9 for share in busy)}"
            )


if __name__ == "__main__":
    main()
