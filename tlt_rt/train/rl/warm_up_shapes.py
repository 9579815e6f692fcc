"""The micro-batch shapes `Learner.warm_up` runs at start-up: a ladder of sizes on both sides of every size
guard torch.compile's graphs check, so that no update meets a shape that compiles a graph again."""

from __future__ import annotations

SDPA_ALIGN = 8  # torch.compile'd attention on CUDA guards on the length being a multiple of this (or not)


def warm_up_shapes(budget: int, per_batch: int, max_len: int, align: int = 0,
                   avoid: tuple[int, ...] = ()) -> list[tuple[int, int]]:  # fmt: skip
    """(samples, rows each) of `Learner.warm_up`'s micro-batches: a batch of one at each length of a ladder up to
    the longest sample's rows (`max_len` - 1, else `budget`), then batches of several at each row count of the
    ladder up to the largest micro-batch's (`budget` rows, else `per_batch` longest samples). With `align`, each
    shape again with its rows a multiple of `align` (up where that fits, else down), none of them in `avoid`:
    the ladder's own sizes are odd, and on a GPU a compiled layer's attention guards on its length being a
    multiple of 8, so a run's first micro-batch of such a length compiled the layer again (3-7 s an update,
    seen in one-GPU RL runs on Qwen2.5-1.5B). From 64 rows on the ladder has four rungs a doubling (5/8, 3/4, 7/8
    and all of it, less one): inductor's size guards are not all at powers of two (on Qwen2.5-1.5B's layer on a
    GPU, rows < 4096 and 1536 x rows < 5,242,880, i.e. rows < 3413, whose band a run met mid-run). A rung whose
    guards an earlier graph passes compiles nothing; it costs one dummy forward and backward.

    Why a ladder: a batch of one is a shape of its own to torch.compile (sizes 0 and 1 are specialised), and
    inductor fits its code to the sizes it compiles with and guards on them. On a CPU the backward of a norm
    sums its weight gradient over the B x T rows and changes how it accumulates past 4096 rows (guard
    B*T <= 4096): after a warm-up of 7-row micro-batches, the first update's micro-batches of thousands of rows
    compiled both norms again, and so did a later update whose only batch of one was a long sample. A size in
    every doubling puts compiled graphs on both sides of every such threshold (of sizes, or rows B*T) that is
    at least a doubling from the next, for both kinds; the ladder's sizes are 2^k - 1, odd, so that no row
    count equals a model width by chance (dynamo would tie the two sizes into one symbol for that graph)."""
    longest = max(max_len - 1 if max_len > 1 else budget, 7)
    largest = budget or per_batch * longest

    def ladder(top: int) -> list[int]:  # 7, 15, 31, ... and from 64 on 5/8, 3/4, 7/8 of each doubling; then top
        sizes = [(1 << k) - 1 for k in range(3, top.bit_length() + 1)]
        sizes += [(f << (k - 3)) - 1 for k in range(7, top.bit_length() + 1) for f in (5, 6, 7)]
        return sorted(n for n in set(sizes) if n < top) + [top]

    shapes = [(1, t) for t in ladder(longest)]
    for n in ladder(largest) if budget or per_batch > 1 else []:
        t = min(longest, n // 2)
        if t >= 2:
            shapes.append((n // t, t))
    if align:
        for b, t in list(shapes):
            up = -(-t // align) * align
            while up in avoid:
                up += align
            fits = up <= longest and (b == 1 or b * up <= largest)
            down = t // align * align
            while down in avoid:
                down -= align
            aligned = up if fits else down
            if aligned >= align:
                shapes.append((b, aligned))
    return list(dict.fromkeys(shapes))
