"""Text the project trains and evaluates on: corpora, synthetic generators, training prompts and held-out suites."""
