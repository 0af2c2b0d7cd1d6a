"""Compare two fingerprint files (``record_plan_fingerprints.py`` or
``benchmarks/plan_fingerprints.py``): every key's list must be identical.

    python scripts/compare_fingerprints.py BEFORE.json AFTER.json

Prints the number of keys compared and every difference; exits 1 on any difference.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    before, after = (json.load(open(p)) for p in sys.argv[1:3])
    diffs = []
    for key in sorted(set(before) | set(after)):
        if before.get(key) != after.get(key):
            diffs.append(f"{key}: {before.get(key)} -> {after.get(key)}")
    print(f"{len(before)} keys before, {len(after)} after")
    for line in diffs:
        print("DIFFERENT", line)
    print("identical" if not diffs else f"{len(diffs)} key(s) differ")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
