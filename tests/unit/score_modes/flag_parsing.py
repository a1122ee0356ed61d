"""The flag and config checks each mode's tests run with its own values."""
import argparse

import pytest

from h2o_vllm.config import H2OConfig
from h2o_vllm.frontend import flags


def parse(argv):
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--additional-config", default={})
    flags.add_h2o_args(parser)
    args = parser.parse_args(argv)
    flags.fold_namespace(args)
    return args.additional_config


def refused(data, message):
    with pytest.raises(ValueError, match=message):
        H2OConfig.from_dict(data)
