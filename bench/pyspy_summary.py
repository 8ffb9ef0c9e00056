"""Summarise ``py-spy record --format raw`` files: the top frames by self and by inclusive share.

``bench/serving.py --profile DIR`` writes one file per profiled process (replica, engine, worker, proxy)
and load level. A raw line is a stack (frames ``function (file:line)``, outermost first, joined by
``;``, prefixed by the thread with ``--threads``) and its sample count. Shares are of all samples taken
in that process (idle threads excluded, as py-spy does by default): with ``--rate R`` over ``T`` s,
``R * T`` samples per busy thread.

    python bench/pyspy_summary.py DIR/*.txt [--top 12]
"""
from __future__ import annotations

import argparse
import re
from collections import Counter

_LINE = re.compile(r":\d+\)$")


def _frame(frame: str) -> str:
    """``fn (path/to/file.py:123)`` -> ``fn (file.py)``."""
    frame = _LINE.sub(")", frame.strip())
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1]}" if where else name


def summarise(path: str, top: int) -> str:
    total, own, incl, threads = 0, Counter(), Counter(), Counter()
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            if frames[0].startswith(("thread (", "process ")):
                threads[frames[0]] += n
                frames = frames[1:]
            frames = [_frame(f) for f in frames if f]
            if not frames:
                continue
            total += n
            own[frames[-1]] += n
            for fr in set(frames):
                incl[fr] += n
    if not total:
        return f"{path}: no samples"
    out = [f"{path}: {total} samples, {len(threads)} thread(s): "
           + ", ".join(f"{t} {100 * c / total:.0f}%" for t, c in threads.most_common(4))]
    out.append("  self:")
    out += [f"    {100 * c / total:5.1f}%  {fr}" for fr, c in own.most_common(top)]
    out.append("  inclusive:")
    out += [f"    {100 * c / total:5.1f}%  {fr}" for fr, c in incl.most_common(top)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    for path in args.files:
        print(summarise(path, args.top))
        print()


if __name__ == "__main__":
    main()
