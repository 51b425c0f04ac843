"""`dgemma bench` as a script: python benchmarks/bench.py --model DIR [options]; last stdout line is JSON."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from dgemma.bench import add_arguments, run  # noqa: E402
from dgemma.errors import DgemmaError  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Benchmark dgemma against the reference and autoregressive "
                                     "decoding on one checkpoint.")
    add_arguments(parser)
    try:
        sys.exit(run(parser.parse_args()))
    except DgemmaError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
