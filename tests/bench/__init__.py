"""Benchmarks' and load tests' smoke runs on the CPU."""
