"""``lowmem report``: the grid of configurations, their analysis, tables and plots.
"""
