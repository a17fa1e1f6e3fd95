"""The conftest that runs fla's own tests/ops/test_gdn.py against deltatrain (bench/gpu/fla_tests.sh puts it
beside the test file as conftest.py): deltatrain.torch.install_as_fla() runs before the test module imports
fla, so its chunk_gated_delta_rule and fused_recurrent_gated_delta_rule are deltatrain's, while the references
the tests compare with (fla.ops.gated_delta_rule.naive) stay fla's. The session fails if the swap did not take,
and its summary counts the calls that reached deltatrain's kernels."""

import collections

import deltatrain.torch as dtt
from deltatrain import _deltatrain

dtt.install_as_fla()

CALLS = collections.Counter()


class _Counting:
    """deltatrain.torch's handle on the kernels, counting each entry point's calls."""

    def __getattr__(self, name):
        function = getattr(_deltatrain.gdn, name)

        def counted(*args, **kwargs):
            CALLS[name] += 1
            return function(*args, **kwargs)

        return counted


dtt._gdn = _Counting()


def pytest_collection_finish(session):
    import fla.ops.gated_delta_rule as fla_gdn

    if fla_gdn.chunk_gated_delta_rule is not dtt.chunk_gated_delta_rule or \
            fla_gdn.fused_recurrent_gated_delta_rule is not dtt.fused_recurrent_gated_delta_rule:
        raise RuntimeError("fla.ops.gated_delta_rule still holds fla's functions: the swap did not take")


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"deltatrain kernel calls: {dict(CALLS)}")
