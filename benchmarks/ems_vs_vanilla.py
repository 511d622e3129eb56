"""EMS-SD vs vanilla vs greedy on SmolLM2-135M with prompt lookup; same as ``specdec bench``.

Writes benchmarks/results/ems_vs_vanilla.{json,md,png}. ``--help`` lists the options;
``--quick`` is a smoke run of a minute or so.
"""

from specdec.bench.ems import main

raise SystemExit(main())
