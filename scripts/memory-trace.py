#!/usr/bin/env python3
"""Replays the allocator's trace and says where a reservation beyond the allocated bytes comes from.

Input: the stderr of a graphed run with GRAPHED_LOG=graphed::memory=trace (a file, or - for
stdin); other lines are skipped. Output, per allocator and arena (the cache outside pools, each
graph pool):
every growth that came while the arena already held enough free bytes for the request, but in no
single block (growth from fragmentation), with the largest free blocks then; and the arena's
blocks at the moment its reservation peaked. Lent segments (another owner's memory) count in
neither reserved nor free.

Usage: GRAPHED_LOG=graphed::memory=trace graphed bench offload --configs L 2> trace.log
       python3 scripts/memory-trace.py trace.log
"""

import re
import sys
from collections import defaultdict

EVENT = re.compile(r"graphed: (alloc|free|grow|segment|shrink|release)\s+(.*)$")
FIELD = re.compile(r"(\w+)=(\S+)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
MIB = 1 << 20


def mib(n):
    return f"{n / MIB:.1f} MiB"


class Arena:
    def __init__(self):
        self.mapped = {}  # segment -> bytes usable
        self.live = {}  # (segment, offset) -> block size
        self.growing = None  # (free bytes, largest free blocks) before a growth, until its request
        self.fragmented = []  # (request, free bytes, largest free blocks)
        self.peak = (0, None)  # (reserved, (allocated, free blocks))

    def reserved(self):
        return sum(self.mapped.values())

    def allocated(self):
        return sum(n for (s, _), n in self.live.items() if s in self.mapped)

    def free_blocks(self):
        used = defaultdict(list)
        for (s, off), n in self.live.items():
            used[s].append((off, n))
        free = []
        for s, size in self.mapped.items():
            at = 0
            for off, n in sorted(used[s]):
                if off > at:
                    free.append((off - at, s, at))
                at = max(at, off + n)
            if size > at:
                free.append((size - at, s, at))
        return sorted(free, reverse=True)

    def event(self, kind, seg, f):
        if kind == "alloc":
            size = int(f["size"])
            self.live[(seg, int(f["offset"]))] = size
            if self.growing is not None:
                free, largest = self.growing
                if free >= size:
                    self.fragmented.append((size, free, largest))
                self.growing = None
        elif kind == "free":
            self.live.pop((seg, int(f["offset"])), None)
        elif kind in ("grow", "segment"):
            # The request a growth serves is the allocation traced right after it.
            self.growing = (self.reserved() - self.allocated(), self.free_blocks()[:4])
            self.mapped[seg] = int(f["size"])
            reserved = self.reserved()
            if reserved > self.peak[0]:
                self.peak = (reserved, None)
        elif kind == "shrink":
            self.mapped[seg] = int(f["size"])
        elif kind == "release":
            self.mapped.pop(seg, None)
        if self.peak[1] is None and self.reserved() == self.peak[0] and kind == "alloc":
            self.peak = (self.peak[0], (self.allocated(), self.free_blocks()))


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "-"
    lines = sys.stdin if path == "-" else open(path, errors="replace")
    arenas = defaultdict(Arena)
    for line in lines:
        m = EVENT.search(ANSI.sub("", line))
        if m:
            f = dict(FIELD.findall(m.group(2)))
            # Pool and segment numbers are each allocator's own (a benchmark makes several).
            arenas[(int(f.get("allocator", 0)), f.get("pool", "None"))].event(m.group(1), int(f.get("segment", 0)), f)
    for (allocator, pool), a in sorted(arenas.items()):
        reserved, state = a.peak
        if state is None:
            continue
        allocated, free = state
        print(f"# allocator {allocator}, arena {pool}: reserved peaked at {mib(reserved)}; right after that growth's request, "
              f"{mib(allocated)} allocated and {mib(reserved - allocated)} free in {len(free)} blocks")
        for size, seg, off in free[:10]:
            print(f"  free {mib(size):>12}  segment {seg} offset {off}")
        for size, free_bytes, largest in a.fragmented:
            blocks = ", ".join(mib(b[0]) for b in largest) or "none"
            print(f"  grew for {mib(size)} while {mib(free_bytes)} was free, the largest blocks {blocks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
