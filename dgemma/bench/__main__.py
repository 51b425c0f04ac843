"""`python -m dgemma.bench --worker JOB_JSON`: one configuration in a fresh interpreter (internal)."""

import sys

from dgemma.bench.trials import worker_main

sys.exit(worker_main(sys.argv[1:]))
