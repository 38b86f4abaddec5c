"""Benchmark harness: synthetic traces (trace), a replayer (replay) and serving metrics (metrics).

Command-line front ends: tools/bench.py (one run), tools/sweep.py (a grid), tools/plot.py (figures).
"""
