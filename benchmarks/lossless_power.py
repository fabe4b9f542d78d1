"""How often the losslessness check (eaglenest.validation.lossless.score_check) flags a corrupted
engine, and how rarely a lossless one, at a given number of sets and requests per set: synthetic
per-request scores, as docs/validation.md reports them.

    python benchmarks/lossless_power.py                      # the embedded default: 2 sets x 6 requests
    python benchmarks/lossless_power.py --requests 8 --draws 100

The target alone's outputs score near -0.02 nats per token (the toy's, measured), with a share
``--tail`` of them low (a rare token); a corrupted engine's outputs are garbage (uniform in [-5, -0.3])
except ``good`` of each set's, which score as the target's own.
"""
import argparse
import random

from eaglenest.validation.lossless import score_check


def target_alone(n, rng, tail):
    return [rng.uniform(-3, -0.5) if rng.random() < tail else -0.02 + rng.gauss(0, 0.005) for _ in range(n)]


def corrupted(n, rng, good):
    return [-0.02 + rng.gauss(0, 0.005) if i < good else rng.uniform(-5, -0.3) for i in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", type=int, default=2)
    ap.add_argument("--requests", type=int, default=6, help="requests per set and side")
    ap.add_argument("--draws", type=int, default=40, help="corrupted runs per row")
    ap.add_argument("--lossless-draws", type=int, default=300)
    ap.add_argument("--permutations", type=int, default=5000)
    args = ap.parse_args()
    rng = random.Random(0)
    n, sets = args.requests, args.sets
    for tail in (0.0, 0.05, 0.1):
        for good in range(min(3, n)):
            fired = sum(not score_check([(corrupted(n, rng, good), target_alone(n, rng, tail)) for _ in range(sets)],
                                        permutations=args.permutations)["lossless"] for _ in range(args.draws))
            print(f"{sets} sets x {n} requests, target-alone tail {tail:.2f}, {good} good output(s) per set: "
                  f"corrupted run flagged {fired} of {args.draws}")
        false = sum(not score_check([(target_alone(n, rng, tail), target_alone(n, rng, tail)) for _ in range(sets)],
                                    permutations=args.permutations)["lossless"] for _ in range(args.lossless_draws))
        print(f"{sets} sets x {n} requests, target-alone tail {tail:.2f}: lossless run flagged {false} of "
              f"{args.lossless_draws}")


if __name__ == "__main__":
    main()
