"""The operations that join the packages: each workflow calls convert, calibrate, runtime and the
Apple targets in turn (they do not import each other) and owns what spans them: one lock on the
artifact for the whole operation, one manifest transaction for what it records together. The API
(api.py) is a facade over these; importing this package loads no torch (every heavy import
happens inside the calls)."""
