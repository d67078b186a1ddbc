"""Benchmarks (not tests): they print numbers and write JSON and plots."""
