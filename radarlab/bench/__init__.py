"""Benchmarks that measure the course's goals and write them as JSON: `python -m radarlab.bench SUBCOMMAND`.

Speed and memory goals are measured here, never in timed unit tests. Each subcommand lives in a module
named after what it measures and writes {"benchmark", "parameters", "environment", "results"}.
"""
