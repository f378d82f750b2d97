"""The `auto` guard of issue 39 over a `lambdanet bench impls` result: exit status 1 when `impl="auto"` took more
than 1.2x the fastest implementation's time at any point (one line per point either way).

    python scripts/check_auto.py bench_results/impls/impls.json [--limit 1.2]
"""

import argparse
import json
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("impls_json", help="the impls.json that `lambdanet bench impls --out DIR` wrote in DIR")
    parser.add_argument("--limit", type=float, default=1.2, help="auto / fastest allowed (default: %(default)s)")
    args = parser.parse_args()
    rows = [r for r in json.load(open(args.impls_json)) if r.get("impl") == "auto" and "auto_over_fastest" in r]
    if not rows:
        print(f"check_auto: no auto rows in {args.impls_json}", file=sys.stderr)
        return 2
    bad = 0
    for r in rows:
        ratio = r["auto_over_fastest"]
        bad += ratio > args.limit
        print(
            f"{'FAIL' if ratio > args.limit else 'ok  '} B{r['batch']} C{r['channels']} {r['side']}x{r['side']} "
            f"{r['scope']}: auto ran {r['auto_impl']}, fastest {r['fastest_impl']}, {ratio:.2f}x"
        )
    print(f"check_auto: {len(rows) - bad}/{len(rows)} points within {args.limit}x of the fastest")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
