"""The project's benchmarks: each one a module run from the repository root as ``python -m benchmarks.<name>``.

Shared harness code (timing, repeats, workloads, the three-file report writer) lives in ``specdec.bench``;
``benchmarks/README.md`` lists every committed result in ``benchmarks/results/`` with the command that
makes it again.
"""
