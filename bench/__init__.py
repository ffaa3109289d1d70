"""mpgen's benchmarks: ``python -m bench`` regenerates docs/benchmarks.md.

Each module measures one table and returns its rows; ``bench.__main__``
prints every table as it is measured and writes the same text to the page.
All numbers are ratios measured in one run (medians of interleaved repeats):
these machines are shared, so seconds mean little and ratios travel.
"""
