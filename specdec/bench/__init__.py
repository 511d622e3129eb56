"""The benchmarks: ``specdec bench`` (EMS-SD vs vanilla vs ar) and ``specdec bench beams`` (DSBD vs beam vs ems).

Split by concern, each name importable from one module only (nothing is re-exported here):

* ``harness``: one timed run, repeated runs of a method, cache sizing, the machine's description;
* ``workloads``: the standard-library prompts, the extractive QA set and its scoring;
* ``report``: the shared json/md/png writer and each program's tables, plots and notes; ``figures``: the figure
  every plot is drawn on;
* ``ems``: the ``specdec bench`` program; ``beams``: the ``specdec bench beams`` program.

The scripts in ``benchmarks/`` build on ``harness``, ``workloads``, ``report`` and ``figures``.
"""
