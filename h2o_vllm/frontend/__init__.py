"""What users touch: the CLI, the engine flags, settings and conflicts checked before the model
loads, the CUDA engine settings, per-request override checks. Runs in process 0."""
