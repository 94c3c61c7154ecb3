"""The engine: the Runtime and what decides, checks and samples around its rounds."""
