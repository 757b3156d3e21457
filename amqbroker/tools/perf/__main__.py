"""``python -m amqbroker.tools.perf``: the load client, and how it starts its own worker
processes (``--_worker SPEC``) and the null broker (``--_null-broker``)."""

import sys

from amqbroker.tools.perf.runner import main

sys.exit(main())
