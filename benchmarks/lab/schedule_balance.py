"""Static model of the Hopper forward's tile schedules: how evenly the persistent CTAs share the causal work.

Each tile (query rows of one batch and head: 192 at D64 from 1024 rows, else 128, as tile_size.h's sm90_causal_block_m)
costs its number of key blocks; a CTA's time is the sum over its tiles; the slowest CTA sets the kernel's time. The
script replays the kernel's tile numbering (Tile in csrc/cuda/sm90/tile_scheduler.h) under the schedules and prints the
slowest CTA's work over the ideal (total work / number of SMs): 1.00 is perfect. The static ones: a fixed stride
(forward v2), zigzag rounds on all SMs (v5), and zigzag rounds on a grid aligned to the query blocks per head (what v8
runs where the host finds such a grid: csrc/cuda/sm90/tile_scheduler.h, causal_zigzag_grid, whose rule is stricter than
zigzag_grid_size below). The counter (the causal fallback): each CTA takes the next tile when it finishes one, in head
order (v8-v14), or with the last heads' tiles longest first across them (v15: tile_scheduler.h, counter_order). The
model reproduces the measured cliffs of v2 and v5 (LOG.md: D128 L16k, D256 L8k and L16k) and the counter's deficit
against zigzag in head order (v13, call 8), so it is used to choose schedules before spending GPU time.

    python benchmarks/lab/schedule_balance.py [--sms 132] [--lengths 1024,...] [--head-dims 64,128,256]
"""
import argparse
import heapq
import itertools

BLOCK_N = {64: 128, 128: 128, 256: 64}  # causal key blocks of FwdTraits (D256: 80 above 2048 keys, not modelled)
COUNTER_TAIL_ROUNDS = 3  # tile_scheduler.h, kCounterTailRounds


def block_m(head_dim: int, length: int) -> int:
    """tile_size.h fwd_tile_shape (queries = keys = length)."""
    return 192 if head_dim == 64 and length >= 1024 else 128


def zigzag_grid_size(num_m_blocks: int, num_sms: int) -> int:
    """The largest grid within 1/8 of num_sms that divides, or is a multiple of, the query blocks per head."""
    size = num_sms
    while size * 8 >= num_sms * 7:
        if size % num_m_blocks == 0 or num_m_blocks % size == 0:
            return size
        size -= 1
    return num_sms


def first_row(m_block: int, num_m_blocks: int, length: int, rows: int) -> int:
    """tile_scheduler.h Tile: the 192-row tiles (kTilesEndAtLq) end at Lq, rounded up to 16 rows; the others start at
    0."""
    rows_before_zero = (num_m_blocks * rows - length) // 16 * 16 if rows == 192 else 0
    return m_block * rows - rows_before_zero


def tile_work(index: int, num_m_blocks: int, length: int, rows: int, block_n: int) -> int:
    m_block = num_m_blocks - 1 - index % num_m_blocks  # causal: each head's longest rows first
    m_end = min(first_row(m_block, num_m_blocks, length, rows) + rows, length)
    return -(-m_end // block_n)  # key blocks up to the diagonal (Lq == Lk)


# A key block's time in the three-consumer D64 kernel by how many consumers compute it: a lone consumer's chain
# takes 0.65 of a full block's time (LOG.md v15, from the L1k grid change); two consumers, 0.9 (a guess).
BLOCK_TIME_BY_CONSUMERS = {3: 1.0, 2: 0.9, 1: 0.65}


def head_time(length: int, end_aligned: bool, rows: int = 192, block_n: int = 128) -> float:
    """One head's causal time in full-block units, three consumers of 64 rows, Lq == Lk; each consumer computes the
    key blocks its own rows see (kSkipUnseenBlocks) and one without rows nothing (kSkipRowlessConsumers). Tiles start
    at 0 (v15) or end at Lq (v16: the part-empty tile first, as first_row places it)."""
    num_m_blocks = -(-length // rows)
    total = 0.0
    for m in range(num_m_blocks):
        start = first_row(m, num_m_blocks, length, rows) if end_aligned else m * rows
        blocks = []
        for c in range(rows // 64):
            first, last = start + 64 * c, min(start + 64 * c + 63, length - 1)
            if last >= 0 and first < length:
                blocks.append(last // block_n + 1)
        for b in range(max(blocks)):
            total += BLOCK_TIME_BY_CONSUMERS[sum(1 for n in blocks if n > b)]
    return total


def counter_order(n: int, num_m_blocks: int, num_tiles: int, tail_heads: int) -> int:
    """tile_scheduler.h counter_order: the n-th tile the counter hands out."""
    tail_start = num_tiles - tail_heads * num_m_blocks
    if n < tail_start or n >= num_tiles:
        return n
    r = n - tail_start
    return tail_start + (r % tail_heads) * num_m_blocks + r // tail_heads


def counter_over_ideal(num_tiles: int, num_m_blocks: int, tail: bool, work, num_sms: int) -> float:
    ctas = min(num_tiles, num_sms)
    tail_heads = min(num_tiles // num_m_blocks, -(-COUNTER_TAIL_ROUNDS * ctas // num_m_blocks)) if tail else 0
    finish = [0] * ctas  # each CTA takes the next tile as it finishes one
    for n in range(num_tiles):
        heapq.heapreplace(finish, finish[0] + work(counter_order(n, num_m_blocks, num_tiles, tail_heads)))
    return max(finish) / (sum(work(i) for i in range(num_tiles)) / num_sms)


def slowest_over_ideal(num_tiles: int, ctas: int, zigzag: bool, work, num_sms: int) -> float:
    per_cta = [0] * ctas
    for round_ in itertools.count():
        if round_ * ctas >= num_tiles:
            break
        for cta in range(ctas):
            index = round_ * ctas + (ctas - 1 - cta if zigzag and round_ % 2 else cta)
            if index < num_tiles:
                per_cta[cta] += work(index)
    return max(per_cta) / (sum(per_cta) / num_sms)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768,16500")
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--tokens", type=int, default=16384, help="B * L, as in bench_sdpa.py")
    parser.add_argument("--hidden", type=int, default=2048, help="H * D, as in bench_sdpa.py")
    args = parser.parse_args()
    print("causal, slowest CTA's work / ideal: stride | zigzag on all SMs | zigzag on the aligned grid (size) | "
          "counter in head order | counter with a longest-first tail")
    for head_dim in map(int, args.head_dims.split(",")):
        for length in map(int, args.lengths.split(",")):
            batch, heads = max(1, args.tokens // length), args.hidden // head_dim
            rows = block_m(head_dim, length)
            num_m_blocks = -(-length // rows)
            num_tiles = num_m_blocks * heads * batch
            work = lambda index: tile_work(index, num_m_blocks, length, rows, BLOCK_N[head_dim])  # noqa: E731
            aligned = zigzag_grid_size(num_m_blocks, args.sms)
            row = [slowest_over_ideal(num_tiles, min(num_tiles, args.sms), False, work, args.sms),
                   slowest_over_ideal(num_tiles, min(num_tiles, args.sms), True, work, args.sms),
                   slowest_over_ideal(num_tiles, min(num_tiles, aligned), True, work, args.sms),
                   counter_over_ideal(num_tiles, num_m_blocks, False, work, args.sms),
                   counter_over_ideal(num_tiles, num_m_blocks, True, work, args.sms)]
            print(f"D{head_dim:<4} L{length:<6} {num_m_blocks:4} query blocks/head: "
                  f"{row[0]:.2f} | {row[1]:.2f} | {row[2]:.2f} ({aligned}) | {row[3]:.3f} | {row[4]:.3f}")
    print("three-consumer D64, causal, one head's time (full key blocks): tiles from 0 | tiles ending at Lq")
    for length in map(int, args.lengths.split(",")):
        if length >= 1024:
            start, end = head_time(length, False), head_time(length, True)
            print(f"L{length:<6} {start:9.2f} | {end:9.2f} ({start / end - 1:+.1%})")


if __name__ == "__main__":
    main()
