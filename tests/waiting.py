"""How long a test waits for a condition before it fails.

A wait polls its condition and ends as soon as it holds; the bound only
decides when a condition that never comes fails the test. It is generous
on purpose: a full suite on a loaded 2-core machine is many times slower
than one test alone, and a test must not fail because the machine is slow
(every timing claim lives in the benchmarks). ``YUXI_TEST_WAIT_SECONDS``
raises or lowers it for a run.
"""

from __future__ import annotations

import os

WAIT_SECONDS = float(os.environ.get("YUXI_TEST_WAIT_SECONDS", "120"))
