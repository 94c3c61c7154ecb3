"""The `dflow-rt` commands: argument parsing and wiring, nothing the library needs."""
