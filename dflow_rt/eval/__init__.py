"""Held-out evaluation of drafters: prompt suites, tau, and the relay diagnostics."""
