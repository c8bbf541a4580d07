"""speculators_cpu_step.py (speculators' own `speculators train` on the CPU, recording
every training forward's loss) with hsx's hidden-states backend registered first, so
that --hidden-states-backend hsx is one of its choices:

    python speculators_online_run.py RESULT.json [speculators train flags ...]

hsx.integrations.speculators must be imported before speculators' config module,
which reads the backend registry when it is imported (python -m
hsx.integrations.speculators does the same)."""

import runpy
from pathlib import Path

import hsx.integrations.speculators  # noqa: F401  (registers the "hsx" backend)

runpy.run_path(str(Path(__file__).with_name("speculators_cpu_step.py")), run_name="__main__")
