"""Process and file primitives every layer may use: threads and allocator tuning, memory
peaks and device memory (`runtime`), atomic file writes (`atomic`), directory locks and
the descriptors a forked worker must not keep (`runlock`).

May import: nothing from rollwise.
"""
