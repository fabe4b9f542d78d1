"""`python -m eaglenest.checks` (`make plan`): the plan of a config file (eaglenest.plan), then its checks, as
the workflow logs them at every start. Here, above the plan, since the checks read the plan's figures."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import yaml

from ..config import resolve_shipped_paths, validate_config
from ..errors import EaglenestError
from ..plan import __doc__ as plan_doc
from ..plan import format_plan, make_plan
from . import check_config


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eaglenest.checks", description=plan_doc.split("\n\n")[0])
    p.add_argument("--configfile", default="config.yaml", help="the workflow config (default: config.yaml)")
    p.add_argument("--directory", "-d", default=".", help="the working directory (default: here)")
    args = p.parse_args(argv)
    try:  # a config the user can fix: one line, no traceback
        config = validate_config(yaml.safe_load(Path(args.configfile).read_text()) or {}, source=args.configfile)
        resolve_shipped_paths(config, args.directory, Path(__file__).resolve().parents[2])
        has_gpu = bool(shutil.which("nvidia-smi"))
        plan = make_plan(config, args.directory, has_gpu=has_gpu)
    except (EaglenestError, OSError) as e:
        sys.exit(f"{args.configfile}: {e}")
    try:
        plan.skipped = check_config(config, plan, args.directory, has_gpu=has_gpu)
    except EaglenestError as e:  # the plan still shows what the run would cost, then every setting to fix
        print(format_plan(plan))
        sys.exit(f"{args.configfile}: {e}")
    print(format_plan(plan))


if __name__ == "__main__":
    main()
