"""Tooling apart from the runtime: offline models, benchmark helpers, the soak load, the demo.

Nothing in the runtime (plugin, scheduler, worker, hooks) imports this package."""
