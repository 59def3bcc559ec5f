"""A toy of the dispatcher's actor choice: do callers that each see only their own batches spread
over a large pool? C caller processes x K threads call back to back with calls of
`pool_throughput.py`'s mix; A actors, each a FIFO GPU serving 169 items/s of the mix (one H100);
each caller picks actors by `DispatchPolicy.choose_actor`'s rule on its own in-flight view (least
own outstanding cost, at most 2 batches per actor), ties broken by lowest index or by an order of
the caller's own. Transport time is ignored; one batch per item.

    python benchmarks/studies/dispatch_ties.py

Seen (this machine, 2026-11-25): 32 callers x 8 threads over 32 actors: lowest-index ties gave 14
actors work (1807 items/s of a GPU-bound 5408); an order per caller gave all 32 work.
"""

import heapq
import random

IMAGE_SIDES = (224, 320, 448, 512, 640, 768, 896, 1024)
VIDEO_SIDES = (224, 320, 448)
PATCH = 16


def random_call(rng):
    if rng.random() < 0.15:
        side = rng.choice(VIDEO_SIDES) // PATCH
        shapes = [(True, (4, side, side))]
    else:
        shapes = [
            (False, (1, rng.choice(IMAGE_SIDES) // PATCH, rng.choice(IMAGE_SIDES) // PATCH))
            for _ in range(rng.choice((1, 1, 2)))
        ]
    rng.randrange(1 << 30)
    return shapes


RATE = 169 * 401.9  # tokens/s of one actor (169 items/s of the benchmark's mix)


def run(C, K, A, seconds=30.0, max_in_flight=2, own_order=False):
    calls = [random_call(r) for r in [random.Random(s) for s in range(C)] for _ in range(24)]
    rng = random.Random(1)
    rank = [
        [(hash((random.Random(100 + c).getrandbits(32), a)) if own_order else a) for a in range(A)]
        for c in range(C)
    ]
    cost = [[0.0] * A for _ in range(C)]
    nfl = [[0] * A for _ in range(C)]
    free_at = [0.0] * A
    served = [0] * A
    busy = [0.0] * A
    queue = [[] for _ in range(C)]
    ev = []
    items = 0
    seq = 0

    def try_send(t, cid):
        nonlocal seq
        while queue[cid]:
            cands = [(cost[cid][a], rank[cid][a], a) for a in range(A) if nfl[cid][a] < max_in_flight]
            if not cands:
                return
            a = min(cands)[2]
            tok, call = queue[cid].pop(0)
            cost[cid][a] += tok
            nfl[cid][a] += 1
            start = max(t, free_at[a])
            free_at[a] = start + tok / RATE
            busy[a] += tok / RATE
            seq += 1
            heapq.heappush(ev, (free_at[a], seq, cid, a, tok, call))

    def new_call(t, cid):
        call = {"left": 0}
        for _, (tt, h, w) in calls[rng.randrange(len(calls))]:
            queue[cid].append((tt * h * w // 4, call))
            call["left"] += 1
        try_send(t, cid)

    for cid in range(C):
        for _ in range(K):
            new_call(0.0, cid)
    while ev:
        t, _, cid, a, tok, call = heapq.heappop(ev)
        if t > seconds:
            break
        cost[cid][a] -= tok
        nfl[cid][a] -= 1
        served[a] += 1
        items += 1
        call["left"] -= 1
        if call["left"] == 0:
            new_call(t, cid)
        try_send(t, cid)
    used = sum(1 for s in served if s > 0)
    return items / seconds, used, [round(min(1, b / seconds), 2) for b in busy]


for own in (False, True):
    for C, K, A in [(8, 8, 4), (32, 8, 32)]:
        ips, used, busy = run(C, K, A, own_order=own)
        print(
            f"own_order={own}: {C} callers x {K} threads, {A} actors: {ips:.0f} items/s (GPU-bound {A * 169}); actors given work {used}; >90% busy {sum(b > 0.9 for b in busy)}"
        )
