"""Development tooling beside the plugin: offline model directories, benchmark helpers, the soak
load generator, a local Prometheus, server start/stop and the ``make demo`` script.

Lives at the repository root and is not part of the ``h2o-vllm`` wheel (pyproject includes
``h2o_vllm*`` only); ``make venv`` puts the checkout on the venv's path (a ``.pth`` file), and
pytest's ``pythonpath`` does the same for the tests. Nothing in ``h2o_vllm`` imports it."""
