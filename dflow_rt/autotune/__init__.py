"""Per-machine tuning of the runtime's knobs: `job` (the measuring search behind `dflow-rt
autotune`) and `cli`; what it writes is read by `dflow_rt.engine.tuned` (kept outside this package).

Nothing is imported here: the Runtime imports `dflow_rt.engine.tuned`, which must not pull in
the job, since the job imports the Runtime.
"""
