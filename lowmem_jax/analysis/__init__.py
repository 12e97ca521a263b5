"""Compile-only analysis of a step: XLA's memory figures and the analytic breakdown, FLOPs,
collectives, the peak's buffers, the verdicts.
"""
