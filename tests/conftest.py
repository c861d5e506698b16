"""Shared test configuration: hypothesis profiles sized for a 2-core CI machine.

``HYPOTHESIS_PROFILE`` picks one (README, "Running the tests"):

* ``ci`` (default): 60 examples per property, derandomized, so every run
  draws the same examples and a failure reproduces as it is;
* ``dev``: 60 examples, drawn afresh each run, to find new failures while
  developing (hypothesis prints the seed blob to reproduce one);
* ``thorough``: 1000 fresh examples per property, for a long run before a
  release or after changing the numerics.
"""

import os

import hypothesis

# Each new shape compiles a fresh XLA program, so examples cost milliseconds,
# not microseconds; deadlines would only measure the compiler.
hypothesis.settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.register_profile(
    "dev", max_examples=60, deadline=None, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.register_profile(
    "thorough", max_examples=1000, deadline=None, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
