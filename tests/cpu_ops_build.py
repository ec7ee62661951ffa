"""The rule for the tests of radarlab's C++ operators: they skip only where no C++ compiler exists.
Where one does, the build must work, and a failed build fails the tests: a compile regression must
not read as a row of skips."""
from __future__ import annotations

import pytest

from radarlab.cpu_ops import COMPILERS, CpuOpsUnavailable, find_compiler, load_cpu_ops

needs_compiler = pytest.mark.skipif(
    find_compiler() is None,
    reason=f"no C++ compiler on PATH ({', '.join(COMPILERS)}, or $CXX): radarlab's C++ "
           "operators cannot be built here")


def built_or_fail():
    """torch.ops.radarlab, or a test failure that says which compiler was there and why the build failed."""
    try:
        return load_cpu_ops()
    except CpuOpsUnavailable as err:
        reason = str(err)
    pytest.fail(f"a C++ compiler was found ({find_compiler()}), so radarlab's C++ "
                f"operators must build: {reason}",
                pytrace=False)
