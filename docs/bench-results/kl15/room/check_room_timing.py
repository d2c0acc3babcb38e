"""Host time of ``Engine._check_room`` for a decode step of ``b`` sequences (the room check every
greedy step runs, ``Engine._fits``), on any build (here the default model compiled for the CPU:
the check is host Python, the same on the GPU machine).

``python3 docs/bench-results/kl15/room/check_room_timing.py BUILD LABEL``: best of 5 x 20,000
calls, us a call, for b = 1, 8, 31."""

import sys
import timeit

from dsv2_mlc.runtime.engine import Engine

res = {}
for b in (1, 8, 31):
    e = Engine(sys.argv[1], context_window=256, max_batch_size=b)
    seqs = [e.add_sequence() for _ in range(b)]
    for i in range(0, b, 4):
        e.prefill(seqs[i : i + 4], [[1, 2, 3]] * len(seqs[i : i + 4]))
    n = 20000
    t = min(timeit.repeat(lambda e=e, s=seqs, b=b: e._check_room(s, [1] * b), number=n, repeat=5))
    res[b] = round(t / n * 1e6, 2)
print(sys.argv[2], res)
