"""Sum a ``py-spy record --format raw`` profile: where the sampled time went.

Prints the top functions by self samples (the leaf frame) and by inclusive samples (any
frame on the stack, counted once per stack), with their share of all samples. With
``py-spy record --gil`` the samples are those of the thread that holds the GIL: the
inclusive share of a function is then the share of the GIL it held.

    py-spy record --gil --format raw -o prof.txt -- \
        python3 benchmarks/diagnostics/threads_floor.py ...
    python3 benchmarks/diagnostics/spy_summary.py prof.txt [--top 40] [--only _PartitionTask]

With ``--native``, a third table pairs each native leaf with the Python frame that led to
it (where a thread waits for the GIL, in the driver, or in a lock); with ``--idle``, the
samples of waiting threads are counted too.
"""

from __future__ import annotations

import argparse
import collections


def frames(stack: str) -> list[str]:
    # "thread (..);fn (file.py:12);..." -> "fn (file.py)": lines of one function merged.
    out = []
    for f in stack.split(";"):
        name, _, where = f.partition(" (")
        out.append(f"{name} ({where.rsplit(':', 1)[0].rstrip(')')})" if where else name)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--only", default="", help="count only stacks with this text in them")
    args = p.parse_args()
    own: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    pairs: collections.Counter = collections.Counter()  # (nearest Python frame, leaf)
    total = 0
    with open(args.raw) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or args.only not in stack:
                continue
            n = int(count)
            total += n
            fs = frames(stack)
            own[fs[-1]] += n
            for name in set(fs):
                incl[name] += n
            py = next((f for f in reversed(fs) if f.endswith(".py)")), "-")
            if py != fs[-1]:  # a native leaf (py-spy --native): where the Python called it
                pairs[f"{fs[-1]}  <-  {py}"] += n
    print(f"{total} samples")
    tables = [("self", own), ("inclusive", incl)]
    if pairs:
        tables.append(("native leaf <- nearest Python frame", pairs))
    for title, table in tables:
        print(f"-- {title}")
        for name, n in table.most_common(args.top):
            print(f"{n / total:6.1%}  {name}")


if __name__ == "__main__":
    main()
