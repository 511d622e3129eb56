"""The edge benchmark's CPU peers: engines a user could run on the same CPU instead of specdec.

Each peer lives in a virtual environment of its own (``benchmarks/peers/install.sh``), never in the
project's: their pins conflict with the project's and with each other's, and none of them is a dependency
of the specdec package. The benchmark process (the project's venv) talks to each peer's child process
over JSON files (``protocol``); llama.cpp runs as its own ``llama-server`` driven over HTTP on
127.0.0.1.
"""
