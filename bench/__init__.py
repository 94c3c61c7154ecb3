"""Benchmarks (`dflow-rt bench`): rerunnable sources of every performance figure we quote."""
