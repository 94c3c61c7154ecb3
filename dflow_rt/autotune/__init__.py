"""Per-machine tuning of the runtime's knobs: `configs` (the loader the Runtime and the CLI read at
start) and `job` (the measuring search behind `dflow-rt autotune`).

Nothing is imported here: the Runtime imports `dflow_rt.autotune.configs`, which must not pull in
the job, since the job imports the Runtime.
"""
