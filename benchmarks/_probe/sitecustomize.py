"""Put on PYTHONPATH by benchmarks/collectives.py (and tests/test_distributed.py): with NEOEMBED_PROBE_DIR set, every
Python process started under it counts its collectives (collective_probe.py); without it, nothing happens."""

import os

if os.environ.get("NEOEMBED_PROBE_DIR"):
    import collective_probe

    collective_probe.install(os.environ["NEOEMBED_PROBE_DIR"])
