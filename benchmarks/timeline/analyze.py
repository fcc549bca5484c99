"""Summarises a timeline CSV from timeline.cu: the tile period, the time between a consumer's S GEMM issues for each key
block (the steady block period where the tensor cores set the pace), and the events around a tile boundary in cycles
from consumer 0's last P V issue (medians over CTAs 0-7 and their tiles 1 .. n-2). Usage: analyze.py timeline_L.csv"""
import csv
import statistics
import sys
from collections import defaultdict

CONSUMER_EVENTS = {0: "tile start", 1: "Q ready", 2: "K[0] ready", 3: "S[0] issued", 25: "previous O read",
                   4: "S[0] done", 5: "P[0] ready", 6: "last P V issued", 7: "last P V done", 21: "O staging acquired",
                   22: "O in staging", 23: "O store issued", 24: "O left the K stage"}
CONSUMER_EVENTS.update({8 + n: f"S[{n}] issued" for n in range(1, 13)})
THIS_TILE, NEXT_TILE = (6, 7, 21, 22, 23, 24), (0, 1, 2, 3, 25, 4, 5, 9)


def producer_event(e):
    return {0: "tile start", 1: "Q part 0 issued", 2: "Q part 1 issued"}.get(e) or \
        f"{'K' if e % 2 else 'V'}[{(e - 3) // 2}] issued"


def main(path):
    t = defaultdict(dict)  # (cta, role, tile) -> {event: clock}
    for cta, role, tile, event, clock in csv.reader(open(path)):
        if int(clock):
            t[(int(cta), int(role), int(tile))][int(event)] = int(clock)
    tiles = max(j for (_, _, j) in t) + 1
    print(f"== {path}: {tiles} tiles per CTA recorded")
    periods = [t[(c, 1, j + 1)][0] - t[(c, 1, j)][0] for c in range(8) for j in range(1, tiles - 1)
               if 0 in t.get((c, 1, j + 1), {}) and 0 in t.get((c, 1, j), {})]
    if periods:
        print(f"tile period (consumer 0): median {statistics.median(periods):.0f} cycles")
    for role in (1, 2):
        gaps = defaultdict(list)
        for (c, r, j), ev in t.items():
            if r == role and j > 0:
                for n in range(2, 13):
                    if 8 + n in ev and 7 + n in ev:
                        gaps[n].append(ev[8 + n] - ev[7 + n])
        print(f"consumer {role - 1}, S[n-1] to S[n] issue, n = 2..12: " +
              " ".join(f"{statistics.median(g):.0f}" for _, g in sorted(gaps.items())))
    for role in (0, 1, 2):
        rows = defaultdict(list)
        for c in range(8):
            for j in range(1, tiles - 1):
                base = t.get((c, 1, j), {}).get(6)
                if base is None:
                    continue
                if role == 0:
                    for e, v in t.get((c, 0, j + 1), {}).items():
                        if e <= 8:
                            rows[("next", producer_event(e))].append(v - base)
                    continue
                for e, v in t.get((c, role, j), {}).items():
                    if e in THIS_TILE:
                        rows[("this", CONSUMER_EVENTS[e])].append(v - base)
                for e, v in t.get((c, role, j + 1), {}).items():
                    if e in NEXT_TILE:
                        rows[("next", CONSUMER_EVENTS[e])].append(v - base)
        print(("producer" if role == 0 else f"consumer {role - 1}") + " (cycles from consumer 0's last P V issue):")
        for key in sorted(rows, key=lambda k: statistics.median(rows[k])):
            print(f"   {key[0]} tile {key[1]:20s} {statistics.median(rows[key]):8.0f}")


if __name__ == "__main__":
    for path in sys.argv[1:]:
        main(path)
