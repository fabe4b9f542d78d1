"""`python -m eaglenest.plan` was the plan's command line; it is `python -m eaglenest.checks` now (`make plan`),
which prints the plan and then the checks: the checks sit above the plan, which imports nothing of theirs."""

import sys

if __name__ == "__main__":
    sys.exit("python -m eaglenest.plan moved: run `python -m eaglenest.checks --configfile X -d WORKDIR` (or `make plan`)")
