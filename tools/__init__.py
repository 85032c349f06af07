"""Operator and data-team tools: the statectl CLI, the demo job, benchmarks."""
