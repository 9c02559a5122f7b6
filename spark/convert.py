"""Convert a trace to Parquet (the native format), validating it on the way.

    python -m spark.convert TRACE_DIR OUT_DIR [--overwrite]
    spark-submit spark/convert.py TRACE_DIR OUT_DIR      # same, on a cluster

Exit status: 0 done, 2 bad input (the message names the file and line).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script (spark-submit spark/convert.py ...)
    _repo = str(Path(__file__).resolve().parents[1])
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    if _repo not in sys.path:
        sys.path.insert(0, _repo)

from spark.extract import TraceFormatError, convert_to_parquet
from spark.session import get_session


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spark.convert", description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--master", default=None)
    args = parser.parse_args(argv)
    spark = get_session(args.master, app_name="kproxy-convert")
    try:
        count = convert_to_parquet(spark, args.trace_dir, args.out_dir, overwrite=args.overwrite)
    except TraceFormatError as exc:
        print(f"bad trace: {exc}", file=sys.stderr)
        return 2
    finally:
        spark.stop()
    print(f"{count} events -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
