"""`dflow-rt serve`: an OpenAI-compatible HTTP server over one Runtime.

`engine` owns the Runtime in one thread and steps it (requests join and leave between steps);
`app` maps the OpenAI API onto it with FastAPI; `text` turns token ids into streamed text with
stop strings; `metrics` is the Prometheus view. The HTTP stack (the `serve` extra) is imported
only by `app` and `cli.run_serve`, so `import dflow_rt` never needs it.
"""
