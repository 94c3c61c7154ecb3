"""The C++ CPU kernels: sources, their one build and loader, and the ops they register (`ops.py`)."""
