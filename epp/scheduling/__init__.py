"""The pure scheduling core: filters, scorers, pickers and the scheduler that runs them.

Nothing in this package performs I/O, reads the wall clock or uses module-level random.
"""
