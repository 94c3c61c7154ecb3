"""Static-shape decoding: the batched round over preallocated state, and its compiled forms."""
